"""How far a static draft tree could take an EAGLE-3 head on a workload, under greedy verification.

Why: the engine drafts a chain, one candidate per position, and on open chat the shipped head's
first candidate is the target's token about 58% of the time; a tree drafts several candidates per
position and verifies them in one target step of more rows. Whether a tree is worth building
depends on two numbers this measures on the same machine: what a tree of a given shape would
accept, and what its verification rows cost.

The acceptance is exact, with no drafting simulated: greedy verification of a tree accepts along
the one branch that holds the target's own tokens, and that branch is in the tree as long as each
of its tokens ranks among the head's top ``w_j`` candidates at its depth ``j``, where the tree's
*widths* ``w_0, w_1, ...`` give the children of every node at each depth (a chain is ``1,1,1``).
The head's distributions along that branch are its training-time test over the target's greedy
answers (:func:`sonar_core.training.methods.eagle3.unroll`: every step fed the right tokens, the
head's own states carried), so one unrolled pass gives the rank of the right token at every
depth and every answer position, and every shape is scored from those ranks by walking each
answer step by step as the engine would (:func:`score_tree`). A position counts when the answer
holds a token at every depth the deepest shape drafts (the last few tokens of each answer do not).

The cost side is the target's: a step of ``1 + nodes`` rows over a decode step, measured as
:mod:`~sonar_core.bench.lookup_bound` measures it. The head's own passes are left out (about a
fifth of a chain step on SmolLM2; a tree's passes score more rows), as is the host work, so the
modelled speedup is an upper bound for each shape.

    python -m sonar_core.training.tree_bound --workload chat --threads 2
"""

from __future__ import annotations

import argparse
import math
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from sonar_core.bench.lookup_bound import add_row_cost_arguments, greedy_answers, row_costs_from
from sonar_core.errors import ConfigError
from sonar_core.spec_decode.vocab_map import DraftVocabularyMap
from sonar_core.training.dataset import StreamingDataset, TrainingSequence
from sonar_core.training.methods.base import FlatBatch
from sonar_core.training.methods.eagle3 import unroll

# Rank given to a right token outside the head's draft vocabulary: no tree drafts it.
NOT_DRAFTABLE = torch.iinfo(torch.int64).max
DEFAULT_TREES = "1,1,1;1,1,1,1,1;2,1,1;3,1,1;3,1,1,1,1;3,2,1;4,2,1;3,2,1,1,1"


@dataclass(frozen=True)
class TreeScore:
    """What a tree of ``widths`` accepts over the scored answers."""

    widths: tuple[int, ...]
    # Share of the walk's steps whose right branch reaches each depth (the per-position acceptance).
    reach: tuple[float, ...]

    @property
    def nodes(self) -> int:
        return tree_nodes(self.widths)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens a step emits: the accepted drafts and the target's own token."""
        return 1.0 + sum(self.reach)


def tree_nodes(widths: Sequence[int]) -> int:
    """Drafted tokens of a tree with ``widths[j]`` children per node at depth ``j``."""
    return sum(math.prod(widths[: depth + 1]) for depth in range(len(widths)))


def score_tree(answers: Sequence[torch.Tensor], widths: Sequence[int]) -> TreeScore:
    """Walk each answer as the engine would with the tree ``widths``: from its first position, a
    step accepts the right branch as deep as it reaches, the target adds its own token, and the next
    step starts after them. ``answers`` hold ``[positions, depth]`` ranks of the right token (0: the
    head's first candidate); the right branch reaches depth ``j`` while every rank up to ``j`` is
    below that depth's width. Scoring only the steps the walk takes, not every position, matters:
    positions inside a run of accepted drafts are easier than those a step lands on."""
    depth = max((ranks.shape[1] for ranks in answers), default=0)
    if not widths or any(w < 1 for w in widths) or len(widths) > depth:
        raise ValueError(f"widths must be 1 to {depth} positive counts, got {list(widths)}")
    bound = torch.tensor(widths, dtype=torch.int64)
    steps = 0
    reached = torch.zeros(len(widths), dtype=torch.int64)
    for ranks in answers:
        accepted = (ranks[:, : len(widths)] < bound).to(torch.int64).cumprod(dim=1)
        lengths = accepted.sum(dim=1).tolist()
        position = 0
        while position < len(lengths):
            steps += 1
            reached += accepted[position]
            position += lengths[position] + 1
    if steps == 0:
        raise ValueError("no answer position to score")
    return TreeScore(tuple(widths), tuple((reached.double() / steps).tolist()))


def parse_trees(text: str) -> list[tuple[int, ...]]:
    """``"1,1,1;3,2,1"`` -> ``[(1, 1, 1), (3, 2, 1)]``."""
    trees = [tuple(int(w) for w in part.split(",")) for part in text.split(";") if part.strip()]
    if not trees or any(not tree or min(tree) < 1 for tree in trees):
        raise ValueError(f"trees are ';'-separated lists of positive widths such as 3,2,1; got {text!r}")
    return trees


def right_token_ranks(head: torch.nn.Module, vocab_map: DraftVocabularyMap,
                      sequences: Iterable[tuple[TrainingSequence, int]], depth: int) -> list[torch.Tensor]:
    """Per answer, ``[positions, depth]``: the rank of the right token among the head's candidates
    at each depth (:data:`NOT_DRAFTABLE` outside its vocabulary).

    ``sequences`` yields (an answer with the head's target states, its prompt length);
    ``vocab_map`` takes the head's vocabulary to the target's.
    Position ``t`` is a step after the target emitted token ``t + 1`` (from the last prompt
    position on); its depth ``j`` drafts token ``t + j + 2``.
    """
    found: list[torch.Tensor] = []
    with torch.no_grad():
        for sequence, prompt_length in sequences:
            batch = FlatBatch([sequence])
            last = sequence.num_rows - depth - 1  # the last position with a token at every depth
            if last < prompt_length - 1:
                continue
            positions = torch.arange(prompt_length - 1, last + 1)
            ranks = torch.empty(positions.numel(), depth, dtype=torch.int64)
            for step, rows, out in unroll(head, batch, depth):
                keep = (rows >= positions[0]) & (rows <= last)
                rows, logits = rows[keep], head.compute_logits(out[keep]).float()
                right = batch.token_after(rows, step + 2).unsqueeze(1)
                # Over the target's vocabulary, the right token's logit is -inf where the head has
                # no such token.
                right_logit = vocab_map.scatter_logits(logits).gather(1, right)
                rank = (logits > right_logit).sum(dim=1)
                ranks[rows - positions[0], step] = torch.where(right_logit.squeeze(1).isinf(), NOT_DRAFTABLE, rank)
            found.append(ranks)
    if not found:
        raise ValueError(f"no answer is longer than {depth + 1} tokens: nothing to score")
    return found


def _default_head(target_dir: Path) -> Path:
    """The head ``{"method": "eagle3"}`` takes for this target without a ``model``."""
    from sonar_eagle.bundled import bundle_for_target, unpacked_head

    bundle = bundle_for_target(target_dir)
    if bundle is None:
        raise ConfigError("head", "no EAGLE-3 head ships for this target", "pass --head with a trained head's folder")
    return unpacked_head(bundle, target_dir)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="target model (default: the embedded SmolLM2)")
    parser.add_argument("--head", type=Path, default=None,
                        help="EAGLE-3 head folder (default: the head that ships for the target)")
    parser.add_argument("--workload", default="chat")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: every core)")
    parser.add_argument("--trees", default=DEFAULT_TREES,
                        help="tree shapes: widths per depth, ';' between shapes (default: %(default)s)")
    add_row_cost_arguments(parser, rounds=20)
    args = parser.parse_args(argv)
    from sonar_eagle.loading import load_head

    from sonar_core.cpu_features import cpu_model, kernel_flags
    from sonar_core.entrypoints.llm import LLM
    from sonar_core.model_files import resolve_model_path
    from sonar_core.models.loader import prepare_model_dir
    from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint
    from sonar_core.training.target import TrainingTarget

    trees = parse_trees(args.trees)
    depth = max(len(tree) for tree in trees)
    rows_needed = 1 + max(tree_nodes(tree) for tree in trees)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    head_dir = args.head or _default_head(prepare_model_dir(resolve_model_path(args.model)))
    target = TrainingTarget.load(args.model)
    head, vocab_map = load_head(DraftCheckpoint.open(str(head_dir)), "eagle3", target.modules, torch.float32,
                                torch.device("cpu"))
    head.eval()
    layers = tuple(head.target_hidden_layers)
    with tempfile.TemporaryDirectory(prefix="sonar-tree-bound-") as states_dir:
        speculative = {"method": "extract_hidden_states", "output_dir": states_dir, "layer_ids": list(layers),
                       "include_final": True}
        llm = LLM(model=args.model, dtype=args.dtype, speculative_config=speculative)
        row_costs = row_costs_from(args, parser, llm, rows_needed)
        answers = greedy_answers(llm, args.workload, args.num_prompts, args.max_tokens)
        dataset = StreamingDataset(sorted(Path(states_dir).glob("*.safetensors")), max_rows=1 << 30, batch_rows=2)
        sequences = ((dataset.load([i], layers, final=False)[0], record.prompt_length)
                     for i, record in enumerate(dataset.records))
        ranks = right_token_ranks(head, vocab_map, sequences, depth)
    print(f"{args.workload}: {len(answers)} greedy answers, {sum(len(a) for _, a in answers)} tokens, "
          f"{sum(r.shape[0] for r in ranks)} scored positions, {args.dtype}, {torch.get_num_threads()} threads; head {head_dir}; "
          f"CPU: {cpu_model()} ({', '.join(kernel_flags()) or 'no listed flags'})")
    print("| tree widths | drafted nodes | verified rows | mean acceptance length | reach by depth "
          "| target step cost | modelled speedup |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for tree in trees:
        score = score_tree(ranks, tree)
        cost = row_costs[score.nodes]  # a step of 1 + nodes rows
        print(f"| {','.join(map(str, tree))} | {score.nodes} | {score.nodes + 1} | {score.mean_acceptance_length:.2f} | "
              f"{' '.join(f'{r:.2f}' for r in score.reach)} | {cost:.2f} | "
              f"{score.mean_acceptance_length / cost:.2f}x |")


if __name__ == "__main__":
    main()
