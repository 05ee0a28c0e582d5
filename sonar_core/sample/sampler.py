"""The plain sampler: one token per row, and the random draws every sampler shares.

Random rows are sampled with the exponential race: with E_v ~ Exp(1) i.i.d.,
``argmax_v p_v / E_v`` is distributed as p (E_v / p_v is exponential with rate p_v, and the
smallest of independent exponentials is v with probability p_v / sum(p)). The race needs no
normalised input and no cumulative sums, costs one vector of noise per row, and gives the same
answer on every backend for the same noise, which is why the rejection sampler uses it too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sonar_core.sample.greedy import argmax_rows
from sonar_core.sample.processing import SamplingBatch, processed_probs

__all__ = ["Sampler", "SamplerOutput", "SamplingBatch", "draw_race_weights", "make_generator"]

# Smallest normal float32. Exp(1) draws can be exactly 0; clamping keeps 1/E finite, and
# p * (1/E) <= 1/tiny stays finite too.
_TINY = torch.finfo(torch.float32).tiny


def make_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """A request's own generator, on the device its noise is drawn on."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


def draw_race_weights(batch: SamplingBatch, vocab_size: int, device: torch.device | str) -> Tensor:
    """[R, V] float32 race weights 1/E, E ~ Exp(1); ``argmax(probs * weights)`` samples probs.

    Rows without a generator share one batched draw from the default generator. A row with a
    generator draws its own V values from that generator only, in row order, so a seeded
    request's sample depends on neither its neighbours nor their number. Greedy rows get weight
    1 (argmax of their one-hot distribution) and consume no randomness.

    The weights are returned as reciprocals so that every backend multiplies (exactly rounded
    everywhere) instead of dividing (approximate in some GPU code paths).
    """
    num_rows = batch.num_rows
    noise = torch.ones((num_rows, vocab_size), dtype=torch.float32, device=device)
    if batch.all_greedy:
        return noise
    greedy = batch.greedy_mask.tolist()
    if any(g is None and not is_greedy for g, is_greedy in zip(batch.generators, greedy, strict=True)):
        noise.exponential_()
    for row, generator in enumerate(batch.generators):
        if generator is not None and not greedy[row]:
            noise[row].exponential_(generator=generator)
    if not batch.all_random:
        noise.masked_fill_(batch.greedy_mask.unsqueeze(1), 1.0)
    return noise.clamp_min_(_TINY).reciprocal_()


@dataclass
class SamplerOutput:
    """One sampled token per row."""

    token_ids: Tensor  # [R] int64
    # [R] float32 logprob of each sampled token under log_softmax(logits), the model's raw
    # distribution (vLLM's default); None unless asked for.
    logprobs: Tensor | None


class Sampler:
    """Samples one token per row: argmax for greedy rows, the processed distribution otherwise."""

    def __call__(self, logits: Tensor, batch: SamplingBatch, want_logprobs: bool = False) -> SamplerOutput:
        logits = logits.float()
        if batch.all_greedy:
            token_ids = argmax_rows(logits)
        else:
            probs = processed_probs(logits, batch)
            weights = draw_race_weights(batch, logits.shape[-1], logits.device)
            # Greedy rows hold one-hot probs and weight 1, so the same argmax picks their argmax.
            token_ids = argmax_rows(probs * weights)
        logprobs = None
        if want_logprobs:
            logprobs = logits.log_softmax(dim=-1).gather(1, token_ids.unsqueeze(1)).squeeze(1)
        return SamplerOutput(token_ids=token_ids, logprobs=logprobs)
