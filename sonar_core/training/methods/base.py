"""What every trainable head provides, and the loss they share.

A :class:`HeadTrainer` wraps the plugin's own head module (the class that drafts at inference),
computes the loss of a batch through that module's forward, and writes the trained head in its
method's published layout. The loss is the cross-entropy of the head's logits against what the
target wants at each position (:class:`RowTargets`: its greedy choice, or its whole distribution
over the head's vocabulary), per draft position, weighted ``DEPTH_DECAY ** position``: later
positions only count when the earlier ones were accepted, so they matter less (EAGLE-3's and
HASS's choice).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from sonar_core.errors import ConfigError
from sonar_core.layers.decoder import fused_projections
from sonar_core.training.dataset import TrainingSequence
from sonar_core.training.methods import LABEL_KINDS
from sonar_core.training.target import TrainingTarget

DEPTH_DECAY = 0.8


@dataclass(frozen=True)
class HeadOptions:
    """The shape of the head to train, and what it learns."""

    # Draft tokens per step the head is trained for (EAGLE-3's unrolled steps, Medusa's heads, the
    # MLP speculator's stages, a DFlash block's drafts).
    depth: int = 3
    # Tokens the head scores (EAGLE-3, Medusa); None: the target's whole vocabulary.
    draft_vocab_size: int | None = None
    # Draft decoder layers (EAGLE-3, DFlash) and their MLP width (None: the target's).
    num_layers: int = 1
    intermediate_size: int | None = None
    # What the head learns at every position: the target's greedy choice ("choice": one token), or
    # the target's whole distribution over the head's vocabulary ("distribution": soft labels,
    # which also say how near the runners-up were, the distribution sampled verification accepts
    # against). Fine-tuning the shipped EAGLE-3 head, both accepted alike (docs/training.md).
    labels: str = "choice"

    def __post_init__(self) -> None:
        if self.labels not in LABEL_KINDS:
            raise ConfigError("labels", f"labels must be one of {', '.join(LABEL_KINDS)}, got {self.labels!r}",
                              f"pass --labels {' or --labels '.join(LABEL_KINDS)}")


@dataclass(frozen=True)
class RowTargets:
    """What the target wants at rows of a batch: its greedy choice at each (an index into the
    head's vocabulary) and, when the head learns distributions, its probabilities over that
    vocabulary. Indexing with rows gives the targets of those rows."""

    choices: torch.Tensor  # [n]
    probabilities: torch.Tensor | None = None  # [n, V'] float32, or None

    def __getitem__(self, rows: torch.Tensor) -> RowTargets:
        return RowTargets(self.choices[rows], None if self.probabilities is None else self.probabilities[rows])


@dataclass
class BatchLoss:
    """A batch's loss and what it says about drafting."""

    loss: torch.Tensor
    # Per draft position: rows scored, and rows whose top draft token is the target's top token
    # (over the head's vocabulary): teacher-forced accuracy of that position, each position fed
    # the right earlier tokens.
    counts: list[int]
    correct: list[int]
    # Per draft position: rows whose drafts at that position and every earlier one are all right,
    # what greedy verification accepts (the engine's per-position acceptance, on these rows).
    chained: list[int] = field(default_factory=list)


class HeadTrainer(ABC):
    """One method's trainable head (see the module docstring)."""

    method: str
    # Target states the head reads (Sonar's index), loaded with each batch; None: final states only.
    layers: tuple[int, ...] | None = None
    # Whether the head can score a reduced draft vocabulary (EAGLE-3, Medusa) or scores them all.
    reduces_vocabulary: ClassVar[bool] = False

    @classmethod
    def create(
        cls,
        target: TrainingTarget,
        options: HeadOptions,
        draft_vocab: torch.Tensor,
        layers: tuple[int, ...],
        mask_token_id: int,
    ) -> HeadTrainer:
        """The trainer from everything the pipeline knows; heads that read target layers (EAGLE-3,
        DFlash) or mark slots with a mask token (DFlash) override it to take them."""
        return cls(target, options, draft_vocab)

    def __init__(self, target: TrainingTarget, options: HeadOptions, draft_vocab: torch.Tensor) -> None:
        self.target = target
        self.options = options
        self.draft_vocab = draft_vocab  # target ids the head scores, ascending
        self.lm_head_rows = target.lm_head_rows(None if self.full_vocabulary else draft_vocab)

    @property
    def full_vocabulary(self) -> bool:
        return self.draft_vocab.shape[0] == self.target.vocab_size

    @property
    @abstractmethod
    def module(self) -> nn.Module:
        """The head module whose trainable parameters the optimiser updates."""

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    @abstractmethod
    def batch_loss(self, sequences: list[TrainingSequence], generator: torch.Generator) -> BatchLoss:
        """The loss of a batch (``generator`` draws anything random, DFlash's anchors)."""

    def start_from(self, head_dir: Path) -> None:
        """Load the weights of a head this method wrote earlier (fine tuning on more data). Only
        EAGLE-3 implements it; the other methods refuse it with a ConfigError."""
        raise ConfigError("init_from", f"{self.method} heads cannot start from an earlier head: only eagle3 "
                          "fine-tunes one", "train this method from scratch (leave out --init-from)")

    @abstractmethod
    def export(self, out_dir: Path, dtype: torch.dtype) -> Path:
        """Write the head in its published layout (weights in ``dtype``); returns ``out_dir``."""

    @torch.no_grad()
    def row_targets(self, final: torch.Tensor) -> RowTargets:
        """What the target wants at each of the final states ``[n, H]`` (rows of a batch), over the
        head's vocabulary: the target's LM head rows of that vocabulary score them."""
        logits = final @ self.lm_head_rows.T
        probabilities = torch.softmax(logits.float(), dim=-1) if self.options.labels == "distribution" else None
        return RowTargets(logits.argmax(dim=-1), probabilities)


class FlatBatch:
    """A batch's sequences laid end to end: row ``r`` is position ``position[r]`` of sequence
    ``seq_of[r]``, and rows of one sequence are consecutive (``bases[i]`` is its first)."""

    def __init__(self, sequences: list[TrainingSequence]) -> None:
        self.sequences = sequences
        self.lengths = torch.tensor([s.num_rows for s in sequences])
        self.bases = self.lengths.cumsum(0) - self.lengths
        self.num_rows = int(self.lengths.sum())
        self.seq_of = torch.repeat_interleave(torch.arange(len(sequences)), self.lengths)
        self.position = torch.arange(self.num_rows) - self.bases[self.seq_of]
        # Tokens are one longer than rows per sequence.
        self._tokens = torch.cat([s.token_ids for s in sequences])
        self._token_base = self.bases + torch.arange(len(sequences))

    def within(self, rows: torch.Tensor, offset: int) -> torch.Tensor:
        """Which ``rows`` have a row ``offset`` positions further in their sequence."""
        return self.position[rows] + offset <= self.lengths[self.seq_of[rows]] - 1

    def token_after(self, rows: torch.Tensor, offset: int) -> torch.Tensor:
        """The token ``offset`` positions after each row's (``offset`` 1: the row's next token)."""
        return self._tokens[self._token_base[self.seq_of[rows]] + self.position[rows] + offset]

    def cat(self, name: str) -> torch.Tensor:
        """The sequences' ``aux`` or ``final`` states, end to end."""
        return torch.cat([getattr(s, name) for s in self.sequences])


class PositionLoss:
    """Accumulates :class:`BatchLoss` over draft positions."""

    def __init__(self, depth: int) -> None:
        self.terms: list[torch.Tensor] = []
        self.counts = [0] * depth
        self.correct = [0] * depth
        self.chained = [0] * depth
        self._alive: torch.Tensor | None = None  # per row id: every draft so far right

    def add(self, position: int, logits: torch.Tensor, targets: RowTargets, rows: torch.Tensor) -> None:
        """Score ``[R, V']`` draft logits against the targets of their ``R`` rows at draft ``position``;
        ``rows`` names the draft each row continues (the row, or anchor, its chain started from),
        positions in order, each position's rows among the previous position's."""
        if logits.shape[0] == 0:
            return
        wanted = targets.choices if targets.probabilities is None else targets.probabilities
        self.terms.append(DEPTH_DECAY**position * F.cross_entropy(logits, wanted))
        right = logits.argmax(-1) == targets.choices
        self.counts[position] += int(logits.shape[0])
        self.correct[position] += int(right.sum())
        size = int(rows.max()) + 1
        alive = torch.zeros(size, dtype=torch.bool)
        if position == 0 or self._alive is None:
            alive[rows] = right
        else:
            before = torch.zeros(max(size, self._alive.numel()), dtype=torch.bool)
            before[: self._alive.numel()] = self._alive
            alive[rows] = right & before[rows]
        self._alive = alive
        self.chained[position] += int(alive.sum())

    def result(self, reference: nn.Module) -> BatchLoss:
        loss = torch.stack(self.terms).sum() if self.terms else _zero(reference)
        return BatchLoss(loss, self.counts, self.correct, self.chained)


def _zero(module: nn.Module) -> torch.Tensor:
    """A zero loss connected to ``module``'s parameters (a batch with nothing to score)."""
    return sum((p.sum() * 0.0 for p in module.parameters() if p.requires_grad), torch.zeros(()))


def checkpoint_tensors(module: nn.Module, layer_config: Any, skip: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    """``module``'s parameters under their checkpoint names: fused projections (``qkv_proj``,
    ``gate_up_proj``) split back into the published ``q/k/v_proj`` and ``gate/up_proj``; names in
    ``skip`` left out. The inverse of how the loaders fill the fused parameters."""
    fused = fused_projections(layer_config)
    tensors: dict[str, torch.Tensor] = {}
    for name, param in module.named_parameters():
        if name in skip:
            continue
        module_name, _, leaf = name.rpartition(".")
        pieces = [(source, start, end) for source, (target, start, end) in fused.items()
                  if module_name == target or module_name.endswith("." + target)]
        if not pieces:
            tensors[name] = param.detach().clone()
            continue
        prefix = module_name[: len(module_name) - len(fused[pieces[0][0]][0])]
        for source, start, end in pieces:
            tensors[f"{prefix}{source}.{leaf}"] = param.detach()[start:end].clone()
    return tensors
