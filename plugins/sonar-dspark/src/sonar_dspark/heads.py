"""DSpark: a DFlash backbone whose block is sampled left to right through a Markov head.

The backbone scores every slot of the block at once (``base_k``); the Markov head then adds a
bias that depends on the token sampled for the slot before (the anchor for the first), so each
draft is conditioned on the previous one without another transformer pass::

    vanilla: bias_k = W2(W1[prev_k])
    gated:   bias_k = W2(sigmoid(gate_proj([h_k, W1[prev_k]])) * W1[prev_k])
    rnn:     (a, c, o) = joint_proj([s_k, W1[prev_k], h_k]);  s_{k+1} = sig(a) s_k + (1 - sig(a)) tanh(c)
             bias_k = W2(tanh(o)),  s_0 = 0

``W1`` is over the target vocabulary (previous tokens are target ids), ``W2`` maps to the draft
vocabulary, and the draft distribution rejection sampling uses is that of ``base_k + bias_k``. An
optional confidence head (``sigmoid(proj([h_k, W1[prev_k]]))``) cuts the proposal at the first
draft whose confidence falls below a threshold.
"""

from __future__ import annotations

import torch
from torch import nn

from sonar_core.errors import ConfigError
from sonar_core.layers.linear import Linear
from sonar_core.models.base import TargetModules
from sonar_core.sample.processing import SamplingBatch
from sonar_core.spec_decode.block_layout import BlockLayout
from sonar_core.spec_decode.block_proposer import BlockDraftHead
from sonar_core.spec_decode.draft_checkpoint import FIELD
from sonar_core.spec_decode.draft_sampling import DraftSample, DraftSampler

MARKOV_TYPES = ("vanilla", "gated", "rnn")


class MarkovHead(nn.Module):
    """The three published variants (``markov_head.*`` in the checkpoint)."""

    def __init__(self, kind: str, vocab_size: int, draft_vocab_size: int, rank: int, hidden_size: int) -> None:
        super().__init__()
        self.kind = kind
        self.rank = rank
        self.markov_w1 = nn.Embedding(vocab_size, rank)
        self.markov_w2 = Linear(rank, draft_vocab_size, bias=False)
        if kind == "gated":
            self.gate_proj = Linear(hidden_size + rank, rank)
        elif kind == "rnn":
            self.joint_proj = Linear(2 * rank + hidden_size, 3 * rank)

    def bias(
        self, prev: torch.Tensor, hidden: torch.Tensor, state: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(bias [R, Vd], next recurrent state)`` for ``[R]`` previous tokens and ``[R, H]`` slot states."""
        prev_embedding = self.markov_w1(prev)
        if self.kind == "vanilla":
            return self.markov_w2(prev_embedding), None
        if self.kind == "gated":
            gate = torch.sigmoid(self.gate_proj(torch.cat((hidden, prev_embedding), dim=-1)))
            return self.markov_w2(gate * prev_embedding), None
        state = torch.zeros_like(prev_embedding) if state is None else state
        gate, candidate, output = self.joint_proj(torch.cat((state, prev_embedding, hidden), dim=-1)).chunk(3, dim=-1)
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return self.markov_w2(torch.tanh(output)), state


class ConfidenceHead(nn.Module):
    """``confidence_head.proj``: the probability that a draft is accepted, from its slot state (and
    the previous token's Markov embedding)."""

    def __init__(self, input_size: int) -> None:
        super().__init__()
        self.proj = Linear(input_size, 1)


class DSparkHead(BlockDraftHead):
    """The backbone plus the Markov head (``markov_rank`` > 0) and the optional confidence head."""

    def __init__(self, layout: BlockLayout, target: TargetModules | None = None, confidence_threshold: float = 0.0) -> None:
        super().__init__(layout, target)
        config = layout.config
        rank = int(config.get("markov_rank") or 0)
        kind = str(config.get("markov_head_type") or "vanilla").lower()
        if rank and kind not in MARKOV_TYPES:
            raise ConfigError(FIELD, f"markov_head_type {kind!r} is not one of {', '.join(MARKOV_TYPES)}",
                              "use a DSpark checkpoint with a published Markov head")
        hidden = layout.layer.hidden_size
        if rank:
            self.markov_head = MarkovHead(kind, layout.vocab_size, layout.draft_vocab_size, rank, hidden)
        self.with_markov_features = bool(config.get("confidence_head_with_markov", True)) and rank > 0
        if config.get("enable_confidence_head"):
            self.confidence_head = ConfidenceHead(hidden + (rank if self.with_markov_features else 0))
        self.confidence_threshold = confidence_threshold

    def draft(
        self,
        slots: torch.Tensor,
        anchors: torch.Tensor,
        depth: int,
        sampler: DraftSampler,
        sampling: SamplingBatch | None,
    ) -> tuple[list[DraftSample], list[int] | None]:
        markov = getattr(self, "markov_head", None)
        prev, state = anchors, None
        samples: list[DraftSample] = []
        confidences: list[torch.Tensor] = []
        for index in range(depth):
            hidden = slots[:, index]
            logits = self.compute_logits(hidden)
            if markov is not None:
                bias, state = markov.bias(prev, hidden, state)
                logits = logits + bias.float()
            if self.confidence_threshold > 0 and hasattr(self, "confidence_head"):
                confidences.append(self._confidence(hidden, prev))
            sample = sampler.sample(logits, sampling)
            samples.append(sample)
            prev = sample.token_ids
        return samples, self._kept(confidences) if confidences else None

    def _confidence(self, hidden: torch.Tensor, prev: torch.Tensor) -> torch.Tensor:
        features = hidden
        if self.with_markov_features:
            features = torch.cat((hidden, self.markov_head.markov_w1(prev)), dim=-1)
        return torch.sigmoid(self.confidence_head.proj(features).float().squeeze(-1))

    def _kept(self, confidences: list[torch.Tensor]) -> list[int]:
        """Per request, the drafts before the first whose confidence is below the threshold."""
        below = torch.stack(confidences, dim=1) < self.confidence_threshold
        depth = below.shape[1]
        first = torch.where(below.any(dim=1), below.int().argmax(dim=1), torch.full_like(below[:, 0], depth, dtype=torch.int64))
        return first.tolist()
