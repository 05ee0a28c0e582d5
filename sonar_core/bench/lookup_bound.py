"""How far any choice of draft depth can take prompt lookup on a workload, given this machine's cost
of verifying more rows.

Why: prompt lookup's drafts are fixed by the context, so all a policy decides is how many of them
to verify. With the target's greedy answers known, every policy can be replayed exactly: a step
proposes the lookup's draft, verifies its first ``d`` tokens, accepts the longest prefix that
matches the answer and emits one token more. Its cost is that of a target step of ``d + 1`` rows
relative to a decode step, measured here on the same model (steps of every size taking turns, so
that a slow spell of the machine hits them alike; or given with ``--row-costs``), so a policy's
*modelled speedup* is tokens emitted over cost spent. The policies:

- ``fixed k``: always the first ``k`` drafts (what ``ngram`` does);
- ``auto``: the engine's ``depth_policy: "auto"`` itself (:class:`OnlineAuto`), learning
  acceptance and the step cost online as it replays, with rates per matched n-gram length (what
  the engine does for prompt lookup) and, for comparison, with one rate per draft position;
- ``by match length``: for each matched n-gram length, the depth that maximises expected tokens
  per cost, from acceptance rates measured on this same replay (in hindsight: about the best a
  policy that decides from the match length can do);
- ``clairvoyant``: exactly the drafts that will be accepted, so that no row is spent on a rejected
  draft (the reference for what any choice of depth can save; where the cost curve is not
  convex, as when one more row needs one more pass over the weights, a policy that stops short of
  an accepted draft can come out slightly ahead of it).

Host work (scheduling, lookup, sampling, output) is left out, so measured speedups sit below the
modelled ones.

    python -m sonar_core.bench.lookup_bound --workload code_edit --threads 2
"""

from __future__ import annotations

import argparse
import logging
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from sonar_core.spec_decode.depth import AdaptiveDepth, PositionCounts, matched_prefix
from sonar_core.spec_decode.prompt_lookup import TOKEN_DTYPE, draft_after, find_match_end

# depth(request, n, drafts, answer_continuation) -> how many of the drafts to verify; ``request``
# is the answer's index, so a policy that learns per request knows where one ends
DepthPolicy = Callable[[int, int, np.ndarray, Sequence[int]], int]


@dataclass(frozen=True)
class Replay:
    """Totals of one policy replayed over a workload's answers."""

    tokens: int
    steps: int
    verified_drafts: int
    cost: float

    @property
    def tokens_per_step(self) -> float:
        return self.tokens / self.steps

    @property
    def modelled_speedup(self) -> float:
        """Tokens per unit of cost, against plain decoding's one token per decode step."""
        return self.tokens / self.cost


class OnlineAuto:
    """``depth_policy: "auto"`` replayed as the engine runs it for prompt lookup: each step cuts
    the whole draft to a depth chosen from what the earlier steps measured, then scores the whole
    draft against the tokens emitted and records the step's cost (``row_costs``, a decode step
    being 1)."""

    def __init__(self, max_depth: int, row_costs: Sequence[float], by_match_length: bool) -> None:
        self.depth = AdaptiveDepth(max_depth)
        self.row_costs = row_costs
        self.by_match_length = by_match_length
        self.request = 0

    def __call__(self, request: int, n: int, drafts: np.ndarray, continuation: Sequence[int]) -> int:
        if request != self.request:  # the previous request finished, as the engine releases it
            self.depth.forget(str(self.request))
            self.request = request
        request_id = str(request)
        source = n if self.by_match_length else None
        chosen = self.depth.choose([request_id], [len(drafts)], [source])[0]
        emitted = continuation[: matched_prefix(drafts[:chosen], continuation) + 1]
        if len(drafts):
            self.depth.observe_outcome(request_id, drafts.tolist(), emitted, source)
        self.depth.observe_step(1 + chosen, len(drafts), self.row_costs[chosen], 0.0)
        return chosen


def replay(
    answers: Sequence[tuple[Sequence[int], Sequence[int]]],
    min_n: int,
    max_n: int,
    max_depth: int,
    depth: DepthPolicy,
    row_costs: Sequence[float],
) -> Replay:
    """Run ``depth`` over every ``(prompt, greedy answer)`` pair (see the module docstring)."""
    tokens = steps = verified = 0
    cost = 0.0
    for request, (prompt, answer) in enumerate(answers):
        sequence = np.array(list(prompt) + list(answer), dtype=TOKEN_DTYPE)
        done = 0
        while done < len(answer):
            context = sequence[: len(prompt) + done]
            end, n = find_match_end(context, min_n, max_n)
            drafts = draft_after(context, end, max_depth)
            continuation = answer[done:]
            verified_here = min(depth(request, n, drafts, continuation), len(drafts))
            emitted = min(matched_prefix(drafts[:verified_here], continuation) + 1, len(continuation))
            done += emitted
            tokens += emitted
            steps += 1
            verified += verified_here
            cost += row_costs[verified_here]
    return Replay(tokens, steps, verified, cost)


def acceptance_by_match_length(
    answers: Sequence[tuple[Sequence[int], Sequence[int]]], min_n: int, max_n: int, max_depth: int
) -> np.ndarray:
    """``[max_n + 1, max_depth]``: the rate at which draft ``j`` is accepted once drafts ``0..j-1``
    were, for each matched n-gram length, replaying full-depth lookup."""
    counts = [PositionCounts.zeros(max_depth) for _ in range(max_n + 1)]

    def record(request: int, n: int, drafts: np.ndarray, continuation: Sequence[int]) -> int:
        counts[n].observe(len(drafts), matched_prefix(drafts, continuation))
        return len(drafts)

    replay(answers, min_n, max_n, max_depth, record, [0.0] * (max_depth + 1))
    return np.stack([c.accepted / np.maximum(c.reached, 1) for c in counts])


def best_depths(rates: np.ndarray, row_costs: Sequence[float]) -> list[int]:
    """For each match length, the depth whose expected tokens per cost is highest."""
    depths = []
    for per_position in rates:
        expected = 1 + np.concatenate(([0.0], np.cumsum(np.cumprod(per_position))))
        value = [expected[d] / row_costs[d] for d in range(len(per_position) + 1)]
        depths.append(int(np.argmax(value)))
    return depths


def policies(
    answers: Sequence[tuple[Sequence[int], Sequence[int]]], min_n: int, max_n: int, max_depth: int,
    row_costs: Sequence[float],
) -> dict[str, DepthPolicy]:
    """The fixed, online auto, by-match-length and clairvoyant policies for one lookup range."""
    by_length = best_depths(acceptance_by_match_length(answers, min_n, max_n, max_depth), row_costs)
    return {
        f"fixed k={max_depth}": lambda request, n, drafts, continuation: len(drafts),
        f"auto, one rate per position (k<={max_depth})": OnlineAuto(max_depth, row_costs, by_match_length=False),
        f"auto, rates per match length (k<={max_depth})": OnlineAuto(max_depth, row_costs, by_match_length=True),
        f"by match length (k<={max_depth}: {by_length[min_n:]})": lambda request, n, drafts, continuation: by_length[n],
        f"clairvoyant (k<={max_depth})": lambda request, n, drafts, continuation: matched_prefix(drafts, continuation),
    }


def greedy_answers(llm: Any, workload: str, num_prompts: int, max_tokens: int) -> list[tuple[list[int], list[int]]]:
    """The target's greedy answers to the workload's first prompts (plain decoding)."""
    from sonar_core.bench.workloads import load_workload, tokenize_workload
    from sonar_core.sampling_params import SamplingParams

    requests = tokenize_workload(llm.get_tokenizer(), load_workload(workload).head(num_prompts))
    prompts = [list(request.prompt_token_ids) for request in requests]
    outputs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=max_tokens), use_tqdm=False)
    return [(prompt, list(output.outputs[0].token_ids)) for prompt, output in zip(prompts, outputs, strict=True)]


def measure_row_costs(llm: Any, max_rows: int, context: int, rounds: int) -> list[float]:
    """Median time of a target step of 1..``max_rows`` rows over ``context`` cached tokens, over
    that of one row; the sizes take turns in every round."""
    from sonar_core.models.step_benchmark import CachedSteps

    engine = llm.engine
    vocab_size = engine.hf_config.get_text_config(decoder=True).vocab_size
    steps = CachedSteps(engine.model, vocab_size, engine.dtype, context, max_rows)
    for rows in range(1, max_rows + 1):
        steps.step(rows)  # warm-up
    samples: list[list[float]] = [[] for _ in range(max_rows)]
    for _ in range(rounds):
        for rows in range(1, max_rows + 1):
            start = time.perf_counter()
            steps.step(rows)
            samples[rows - 1].append(time.perf_counter() - start)
    medians = [statistics.median(times) for times in samples]
    return [median / medians[0] for median in medians]


def add_row_cost_arguments(parser: argparse.ArgumentParser, rounds: int) -> None:
    """The options of the step costs a bound tool prices its steps with: given, or measured on the
    target (``rounds`` by default)."""
    parser.add_argument("--row-costs", default=None,
                        help="cost of a step of 1, 2, ... rows over a decode step, comma-separated, "
                        "instead of measuring them")
    parser.add_argument("--context", type=int, default=256, help="cached tokens of the measured steps")
    parser.add_argument("--rounds", type=int, default=rounds, help="rounds of the measured steps")


def row_costs_from(args: argparse.Namespace, parser: argparse.ArgumentParser, llm: Any, rows: int) -> list[float]:
    """Costs of steps of 1 to ``rows`` rows over a decode step: ``--row-costs`` (refused when it
    does not reach ``rows``) or measured on ``llm``'s target."""
    if args.row_costs is None:
        return measure_row_costs(llm, rows, args.context, args.rounds)
    costs = [float(cost) for cost in args.row_costs.split(",")]
    if len(costs) < rows:
        parser.error(f"--row-costs needs {rows} values (steps of 1 to {rows} rows)")
    return costs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None, help="target model (default: the embedded SmolLM2)")
    parser.add_argument("--workload", default="code_edit")
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads (default: every core)")
    parser.add_argument("--depths", default="5,8", help="largest depths replayed, comma-separated")
    add_row_cost_arguments(parser, rounds=40)
    args = parser.parse_args(argv)
    from sonar_core.cpu_features import cpu_model, kernel_flags
    from sonar_core.entrypoints.llm import LLM

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    # The replayed auto policy logs each time speculation turns off or on, which a replay of many
    # short answers does often.
    logging.getLogger("sonar.spec_decode").setLevel(logging.WARNING)
    depths = [int(depth) for depth in args.depths.split(",")]
    llm = LLM(model=args.model, dtype=args.dtype)
    row_costs = row_costs_from(args, parser, llm, max(depths) + 1)
    answers = greedy_answers(llm, args.workload, args.num_prompts, args.max_tokens)
    print(f"{args.workload}: {len(answers)} greedy answers, {sum(len(a) for _, a in answers)} tokens, {args.dtype}, "
          f"{torch.get_num_threads()} threads; CPU: {cpu_model()} ({', '.join(kernel_flags()) or 'no listed flags'})")
    print("step cost by rows (1 = a decode step): " + ", ".join(f"{rows}: {cost:.2f}" for rows, cost in
                                                                 enumerate(row_costs, start=1)))
    print("| lookup | policy | tokens/step | verified drafts/step | modelled speedup |")
    print("| --- | --- | --- | --- | --- |")
    for min_n in (1, 2):
        for max_depth in depths:
            for name, depth in policies(answers, min_n, 5, max_depth, row_costs).items():
                result = replay(answers, min_n, 5, max_depth, depth, row_costs)
                print(f"| n={min_n}..5 | {name} | {result.tokens_per_step:.2f} | "
                      f"{result.verified_drafts / result.steps:.2f} | {result.modelled_speedup:.2f}x |")


if __name__ == "__main__":
    main()
