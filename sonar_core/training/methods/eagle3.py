"""Training an EAGLE-3 head (sonar-eagle's :class:`~sonar_eagle.heads.Eagle3Head`), written in the
vllm-project/speculators layout.

The training-time test of EAGLE-3: the head is unrolled ``depth`` steps over every position at
once, exactly as :class:`~sonar_core.spec_decode.chain_proposer.ChainProposer` drafts:

* step 0 is the first pass: row ``t`` reads the fused target states at ``t`` and token ``t + 1``
  at position ``t``, causally over the whole sequence, and predicts the target's distribution at
  ``t + 1``;
* step ``j`` continues row ``t`` from the head's own output of step ``j - 1`` with token
  ``t + j + 1`` at position ``t + j``, attending to the first pass up to ``t`` and to its own
  earlier steps (private slots, :func:`~sonar_core.training.paged.rows_over_context`), and predicts
  the distribution at ``t + j + 1``.

The tokens fed to later steps are the sequence's (the target's own greedy answer): a draft is only
kept while it equals them. Gradients flow through the chain of hidden states.

The head starts from the target's own next-token guess (see :meth:`Eagle3Trainer._initialise`) and
reads a reduced vocabulary (``d2t``/``t2d``) whose LM head is the target's rows of those tokens,
frozen; ``fc_norm`` normalises each target state before ``fc`` (their
scales differ by orders of magnitude between layers) and ``norm_before_residual`` keeps the fused
state's scale out of the residual stream.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn

from sonar_core.errors import ConfigError
from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint
from sonar_core.spec_decode.draft_layouts import (
    draft_layer_config,
    eagle3_speculators_config,
    save_draft_checkpoint,
    vocab_maps,
)
from sonar_core.spec_decode.proposer import TargetHiddenStates
from sonar_core.spec_decode.speculators_format import SpeculatorsConfig
from sonar_core.training import paged
from sonar_core.training.dataset import TrainingSequence
from sonar_core.training.methods.base import (
    BatchLoss,
    FlatBatch,
    HeadOptions,
    HeadTrainer,
    PositionLoss,
    checkpoint_tensors,
)
from sonar_core.training.target import TrainingTarget


class Eagle3Trainer(HeadTrainer):
    method = "eagle3"
    reduces_vocabulary = True

    @classmethod
    def create(
        cls,
        target: TrainingTarget,
        options: HeadOptions,
        draft_vocab: torch.Tensor,
        layers: tuple[int, ...],
        mask_token_id: int,
    ) -> Eagle3Trainer:
        return cls(target, options, draft_vocab, layers)

    def __init__(
        self, target: TrainingTarget, options: HeadOptions, draft_vocab: torch.Tensor, layers: tuple[int, ...]
    ) -> None:
        from sonar_eagle.heads import Eagle3Head
        from sonar_eagle.layout import TargetShape, read_layout

        super().__init__(target, options, draft_vocab)
        hidden, vocab = target.hidden_size, target.vocab_size
        overrides = {"intermediate_size": options.intermediate_size} if options.intermediate_size else {}
        layer_config = draft_layer_config(target.config, options.num_layers, **overrides)
        draft_size = int(draft_vocab.shape[0])
        self.config = eagle3_speculators_config(
            layer_config, target.config, draft_vocab_size=draft_size, aux_layers=list(layers),
            trained_depth=options.depth, verifier=target.name, norm_before_residual=True, fc_norm=True,
        )
        # The layout the plugin will read from the written files: the same config, the same names.
        shapes = {"fc.weight": (hidden, len(layers) * hidden), "lm_head.weight": (draft_size, hidden)}
        if draft_size < vocab:
            shapes.update({"d2t": (draft_size,), "t2d": (vocab,)})
        checkpoint = DraftCheckpoint("trained head", Path("."), self.config, shapes, SpeculatorsConfig.from_config(self.config))
        self.layout = read_layout(checkpoint, "eagle3", TargetShape(hidden, target.num_layers, vocab))
        self.layers = self.layout.target_hidden_layers
        self.head = Eagle3Head(self.layout, target.modules)
        self._initialise()

    @torch.no_grad()
    def _initialise(self) -> None:
        """Start as "the target's own next-token guess": ``fc`` passes the deepest target state
        through (the others enter small), every layer's residual branches (``o_proj``,
        ``down_proj``) start at zero, and ``norm`` and the LM head are the target's. The first
        steps then refine a sensible prediction instead of leaving noise."""
        hidden = self.target.hidden_size
        fc = self.head.fc.weight
        fc.mul_(0.1)
        fc[:, -hidden:] += torch.eye(hidden)
        for layer in self.head.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        self.head.norm.weight.copy_(self.target.modules.final_norm.weight)
        self.head.lm_head.weight.copy_(self.lm_head_rows)
        self.head.lm_head.weight.requires_grad_(False)

    @property
    def module(self) -> nn.Module:
        return self.head

    @torch.no_grad()
    def start_from(self, head_dir: Path) -> None:
        """Start from the weights of a head written earlier for the same target and shape (fine
        tuning on more data): every trained tensor; the LM head stays the target's rows of this
        run's draft vocabulary, which more data can change. An earlier head with fewer layers
        grows: its layers are taken and the added ones keep their start as identities (zero
        residual branches), so training starts from the earlier head's very predictions."""
        from sonar_eagle.loading import load_head

        earlier, _ = load_head(DraftCheckpoint.open(str(head_dir)), "eagle3", self.target.modules, torch.float32,
                               torch.device("cpu"))
        mine = self.head.state_dict()
        theirs = {name: t for name, t in earlier.state_dict().items() if name != "lm_head.weight"}
        added = _added_layer_names(mine, len(earlier.layers), len(self.head.layers))
        names = (set(mine) - {"lm_head.weight"} - added) | set(theirs)
        differing = sorted(n for n in names if n not in mine or n not in theirs or theirs[n].shape != mine[n].shape)
        if differing:
            raise ConfigError("init_from", f"{head_dir} is not a head of this shape (differs in {differing[0]})",
                              "start from a head trained with the same target and sizes, and no more layers")
        for name, tensor in theirs.items():
            mine[name].copy_(tensor)

    def batch_loss(self, sequences: list[TrainingSequence], generator: torch.Generator) -> BatchLoss:
        batch = FlatBatch(sequences)
        targets = self.row_targets(batch.cat("final"))
        losses = PositionLoss(self.options.depth)
        for step, rows, out in self.unroll(batch):
            losses.add(step, self.head.compute_logits(out), targets[rows + step + 1], rows)
        return losses.result(self.head)

    def unroll(self, batch: FlatBatch) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
        """The training-time test of this trainer's head over ``batch`` (:func:`unroll`)."""
        return unroll(self.head, batch, self.options.depth)

    def export(self, out_dir: Path, dtype: torch.dtype) -> Path:
        tensors = {name: t.to(dtype) for name, t in checkpoint_tensors(self.head, self.layout.layer).items()}
        if self.layout.has_vocab_map:
            tensors.update(vocab_maps(self.draft_vocab, self.target.vocab_size))
        return save_draft_checkpoint(out_dir, tensors, self.config)


def unroll(head: nn.Module, batch: FlatBatch, depth: int) -> Iterator[tuple[int, torch.Tensor, torch.Tensor]]:
    """The training-time test of an EAGLE-3 ``head`` (sonar-eagle's ``Eagle3Head``) over ``batch``,
    ``depth`` steps: per step, the rows that ran it (those with a label ``step + 1`` positions on)
    and the head's output for them, whose logits predict the target's distribution at
    ``rows + step + 1``. Every step is fed the sequence's own tokens, so step ``j`` at row ``t`` is
    the draft a chain (or the branch of a draft tree) that holds the right tokens so far makes."""
    total = batch.num_rows
    all_rows = torch.arange(total)
    # Step 0: the first pass over every row (all of them are the later steps' context).
    metadata = paged.prefill(batch.lengths.tolist(), batch.bases.tolist())
    # Rows that run later steps: those with a label two positions on.
    chained = all_rows[batch.within(all_rows, 2)] if depth > 1 else all_rows[:0]
    cache = paged.new_cache(head.kv_layers, total + chained.numel() * (depth - 1))
    states = TargetHiddenStates(head.target_hidden_layers, head.layout.target_hidden_size, aux=batch.cat("aux"))
    hidden = head.target_input(states, all_rows)
    out, carry = head(batch.token_after(all_rows, 1), hidden, metadata.positions, cache, metadata, 0)
    scored = all_rows[batch.within(all_rows, 1)]
    yield 0, scored, out.index_select(0, scored)

    # Steps 1 .. depth-1: each chained row one position further, over its private slots.
    slots = total + torch.arange(chained.numel() * (depth - 1)).view(-1, depth - 1)
    index = torch.arange(chained.numel())  # into chained (and slots)
    carry = carry.index_select(0, chained)
    for step in range(1, depth):
        keep = batch.within(chained[index], step + 1)
        index, carry = index[keep], carry[keep]
        if index.numel() == 0:
            return
        rows = chained[index]
        metadata = paged.rows_over_context(
            batch.bases[batch.seq_of[rows]], batch.position[rows] + 1, slots[index, :step], query_len=1
        )
        out, carry = head(batch.token_after(rows, step + 1), carry, metadata.positions, cache, metadata, step)
        yield step, rows, out


def _added_layer_names(state: dict[str, torch.Tensor], earlier_layers: int, layers: int) -> set[str]:
    """The names in ``state`` of layers ``earlier_layers .. layers - 1``: what growing a head adds."""
    added = tuple(f"layers.{i}." for i in range(earlier_layers, layers))
    return {name for name in state if name.startswith(added)}
