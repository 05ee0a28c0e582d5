"""Batched draft sampling for proposers that draft from logits (EAGLE, MTP, DFlash, Medusa, ...).

Greedy drafting takes the argmax and hands no probabilities over: the rejection sampler verifies
one-hot drafts. Probabilistic drafting (``draft_sample_method: "probabilistic"``) samples each
request's draft from the draft distribution shaped by the request's own temperature, top-k, top-p
and min-p (``processed_probs``, the function the target's distribution comes from), with the
request's own generator when it is seeded, and keeps those probabilities: speculative sampling is
then lossless for any draft distribution. Greedy requests draft their argmax with a one-hot
probability in either mode. Token ids and probabilities are handed over in the target vocabulary
through the proposer's :class:`~sonar_core.spec_decode.vocab_map.DraftVocabularyMap`.

Everything stays on the device: a chain of k draft steps reads nothing back until its end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonar_core.sample.greedy import argmax_rows
from sonar_core.sample.processing import SamplingBatch, processed_probs
from sonar_core.sample.sampler import draw_race_weights
from sonar_core.sampling_params import SamplingParams
from sonar_core.spec_decode.proposer import ProposalRequest, ProposerContext
from sonar_core.spec_decode.vocab_map import DraftVocabularyMap

_GREEDY = SamplingParams(temperature=0.0)

# The head's probability of its first draft from which that draft is taken as sure and the
# request gets no draft branches that step. Measured with the shipped EAGLE-3 head on the chat
# benchmark (600 steps, three chains of four): above 0.9 its first draft was right 94% of the time
# and a branch won 2% of those steps; from 0.8 to 0.9, 70% and 23%. Leaving those steps without
# branches kept 2.52 of 2.52 tokens a step and saved a fifth of the branch rows.
BRANCH_CONFIDENCE = 0.9


@dataclass
class DraftSample:
    """One draft token per row, in the target vocabulary."""

    token_ids: torch.Tensor  # [R] int64 target ids
    probs: torch.Tensor | None  # [R, V] float32 target-vocabulary probabilities (probabilistic mode)


class DraftSampler:
    """Samples draft tokens for a fixed set of requests (one row each) through a chain of steps."""

    def __init__(self, vocab_map: DraftVocabularyMap, probabilistic: bool, device: torch.device | str) -> None:
        self.vocab_map = vocab_map
        self.probabilistic = probabilistic
        self.device = device

    @classmethod
    def for_context(cls, vocab_map: DraftVocabularyMap, context: ProposerContext) -> DraftSampler:
        """The sampler a learned head uses: probabilistic when the speculative config's
        ``draft_sample_method`` asks for it, on the proposer's device."""
        probabilistic = context.speculative_config.draft_sample_method == "probabilistic"
        return cls(vocab_map, probabilistic, context.device)

    def batch_for(self, requests: list[ProposalRequest]) -> SamplingBatch | None:
        """The rows' sampling settings; None in greedy mode (argmax, no probabilities)."""
        if not self.probabilistic:
            return None
        params = [r.params if r.params is not None else _GREEDY for r in requests]
        return SamplingBatch.from_params(params, [r.generator for r in requests], self.device)

    def sample(self, logits: torch.Tensor, batch: SamplingBatch | None) -> DraftSample:
        """``[R, Vd]`` draft logits -> one token per row (and its distribution when probabilistic)."""
        logits = logits.float()
        if batch is None:
            return DraftSample(self.vocab_map.to_target(argmax_rows(logits)), None)
        probs = processed_probs(logits, batch)
        if batch.all_greedy:
            draft_ids = argmax_rows(probs)
        else:
            # The exponential race (see sonar_core.sample.sampler): greedy rows hold one-hot
            # probabilities and weight 1, so the same argmax picks their argmax.
            draft_ids = argmax_rows(probs * draw_race_weights(batch, probs.shape[-1], probs.device))
        return DraftSample(self.vocab_map.to_target(draft_ids), self.vocab_map.scatter_probs(probs))

    def sure(self, logits: torch.Tensor) -> list[bool]:
        """Per row of ``[R, Vd]`` draft logits, whether the head's own distribution (temperature 1)
        puts at least :data:`BRANCH_CONFIDENCE` on its most likely token: a draft branch there
        would cost its rows and almost never win."""
        top = torch.softmax(logits.float(), dim=-1).amax(dim=-1)
        return (top >= BRANCH_CONFIDENCE).tolist()

    def alternatives(self, logits: torch.Tensor, chosen: torch.Tensor, counts: list[int]) -> list[list[int]]:
        """The ``counts[i]`` most likely tokens of row ``i`` of ``[R, Vd]`` draft logits other than
        its ``chosen`` draft (target ids): the first drafts of a request's draft branches."""
        width = min(max(counts, default=0) + 1, logits.shape[-1])
        if width <= 1:
            return [[] for _ in counts]
        ranked = self.vocab_map.to_target(logits.float().topk(width, dim=-1).indices).tolist()
        return [
            [token for token in row if token != first][:count]
            for row, first, count in zip(ranked, chosen.tolist(), counts, strict=True)
        ]
