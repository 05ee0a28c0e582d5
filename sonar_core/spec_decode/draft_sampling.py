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

from sonar_core.sample.greedy import argmax_and_top_probability, argmax_rows
from sonar_core.sample.processing import SamplingBatch, processed_probs
from sonar_core.sample.sampler import draw_race_weights
from sonar_core.sampling_params import SamplingParams
from sonar_core.spec_decode.proposer import ProposalRequest, ProposerContext
from sonar_core.spec_decode.vocab_map import DraftVocabularyMap

_GREEDY = SamplingParams(temperature=0.0)


@dataclass
class DraftSample:
    """One draft token per row, in the target vocabulary."""

    token_ids: torch.Tensor  # [R] int64 target ids
    probs: torch.Tensor | None  # [R, V] float32 target-vocabulary probabilities (probabilistic mode)
    # Per row, the head's probability (temperature 1) of its most likely token, where asked for.
    top_probabilities: list[float] | None = None


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

    def sample(self, logits: torch.Tensor, batch: SamplingBatch | None, confidence: bool = False) -> DraftSample:
        """``[R, Vd]`` draft logits -> one token per row (and its distribution when probabilistic;
        with ``confidence``, the head's :meth:`top_probabilities` too, in the pick's kernel call
        when greedy)."""
        logits = logits.float()
        if batch is None:
            if confidence:
                draft_ids, top = argmax_and_top_probability(logits)
                return DraftSample(self.vocab_map.to_target(draft_ids), None, top.tolist())
            return DraftSample(self.vocab_map.to_target(argmax_rows(logits)), None)
        top_probabilities = self.top_probabilities(logits) if confidence else None
        probs = processed_probs(logits, batch)
        if batch.all_greedy:
            draft_ids = argmax_rows(probs)
        else:
            # The exponential race (see sonar_core.sample.sampler): greedy rows hold one-hot
            # probabilities and weight 1, so the same argmax picks their argmax.
            draft_ids = argmax_rows(probs * draw_race_weights(batch, probs.shape[-1], probs.device))
        return DraftSample(self.vocab_map.to_target(draft_ids), self.vocab_map.scatter_probs(probs), top_probabilities)

    @staticmethod
    def top_probabilities(logits: torch.Tensor) -> list[float]:
        """Per row of ``[R, Vd]`` draft logits, the head's probability (temperature 1) of its most
        likely token: how sure it is there (the drafted token's probability when greedy)."""
        return argmax_and_top_probability(logits.float())[1].tolist()

    def alternatives(
        self, logits: torch.Tensor, chosen: torch.Tensor, counts: list[int]
    ) -> tuple[list[list[int]], list[list[float]]]:
        """The ``counts[i]`` most likely tokens of row ``i`` of ``[R, Vd]`` draft logits other than
        its ``chosen`` draft (target ids), the first drafts of a request's draft branches, and the
        head's probability (temperature 1) of each."""
        width = min(max(counts, default=0) + 1, logits.shape[-1])
        if width <= 1:
            return [[] for _ in counts], [[] for _ in counts]
        top = torch.softmax(logits.float(), dim=-1).topk(width, dim=-1)
        ranked, probabilities = self.vocab_map.to_target(top.indices).tolist(), top.values.tolist()
        tokens: list[list[int]] = []
        token_probabilities: list[list[float]] = []
        for row, row_probabilities, first, count in zip(ranked, probabilities, chosen.tolist(), counts, strict=True):
            kept = [(token, p) for token, p in zip(row, row_probabilities, strict=True) if token != first][:count]
            tokens.append([token for token, _ in kept])
            token_probabilities.append([p for _, p in kept])
        return tokens, token_probabilities
