"""The target distribution: how temperature, top-k, top-p and min-p shape a row of logits.

This module is the one definition of "the distribution a request samples from". The plain
sampler draws from it and the rejection sampler accepts drafts against it, so a request's
settings mean the same with speculation on and off, and speculative sampling stays lossless with
respect to exactly this distribution.

Order of operations: divide by the temperature, keep the top-k logits (ties with the k-th value
are kept), keep the smallest nucleus whose probability reaches top-p (at least one token), then
drop tokens whose probability is below ``min_p`` times the largest remaining probability, and
normalise what is left. Each rule is vLLM's; the order is that of vLLM's V0 sampler (its V1
sampler applies min-p first, which differs only when min-p is combined with top-k or top-p).
Greedy rows (temperature 0) get a one-hot distribution at the argmax (lowest index on ties),
which is what greedy decoding samples from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from sonar_core.sample.greedy import argmax_rows
from sonar_core.sampling_params import SamplingParams

# Temperatures below this are greedy: dividing logits by a tiny temperature overflows float32.
SAMPLING_EPS = 1e-5


@dataclass
class SamplingBatch:
    """Per-row sampling settings, built once per step by the engine from each request's params."""

    temperature: Tensor  # [R] float32, 0 where the row is greedy
    top_k: Tensor  # [R] int64, 0 = off
    top_p: Tensor  # [R] float32, 1 = off
    min_p: Tensor  # [R] float32, 0 = off
    all_greedy: bool  # every row is greedy: no probabilities or noise are needed
    all_random: bool  # no row is greedy
    generators: list[torch.Generator | None]  # [R] a row's own generator; None = default generator

    @classmethod
    def from_params(
        cls,
        params: list[SamplingParams],
        generators: list[torch.Generator | None],
        device: torch.device | str,
    ) -> SamplingBatch:
        """Gather the settings of ``params`` (one per row) into tensors on ``device``."""
        if len(params) != len(generators):
            raise ValueError(f"got {len(params)} sampling params but {len(generators)} generators")
        temperature = [0.0 if p.temperature < SAMPLING_EPS else p.temperature for p in params]
        greedy = [t == 0.0 for t in temperature]
        return cls(
            temperature=torch.tensor(temperature, dtype=torch.float32, device=device),
            top_k=torch.tensor([max(p.top_k, 0) for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            min_p=torch.tensor([p.min_p for p in params], dtype=torch.float32, device=device),
            all_greedy=all(greedy),
            all_random=not any(greedy),
            generators=list(generators),
        )

    @property
    def num_rows(self) -> int:
        return len(self.generators)

    @property
    def greedy_mask(self) -> Tensor:
        """[R] bool, True for greedy rows."""
        return self.temperature == 0.0

    def repeat_rows(self, counts: list[int]) -> SamplingBatch:
        """Row i repeated ``counts[i]`` times (the verifier scores k_i + 1 rows per request).

        Repeated rows share the request's generator object; only the per-request draws of the
        rejection sampler use it, so sharing never changes what a seeded request consumes.
        """
        if len(counts) != self.num_rows:
            raise ValueError(f"got {len(counts)} repeat counts for {self.num_rows} rows")
        repeats = torch.tensor(counts, dtype=torch.int64, device=self.temperature.device)
        return SamplingBatch(
            temperature=self.temperature.repeat_interleave(repeats),
            top_k=self.top_k.repeat_interleave(repeats),
            top_p=self.top_p.repeat_interleave(repeats),
            min_p=self.min_p.repeat_interleave(repeats),
            all_greedy=self.all_greedy,
            all_random=self.all_random,
            generators=[g for g, n in zip(self.generators, counts, strict=True) for _ in range(n)],
        )

    def select(self, rows: list[int]) -> SamplingBatch:
        """Only ``rows`` (ascending, each once), as a batch of their own."""
        if sorted(set(rows)) != rows:
            raise ValueError(f"rows must be ascending and distinct, got {rows}")
        if len(rows) == self.num_rows:  # ascending and distinct: every row
            return self
        chosen = set(rows)
        return self.repeat_rows([1 if row in chosen else 0 for row in range(self.num_rows)])


def processed_probs(logits: Tensor, batch: SamplingBatch) -> Tensor:
    """[R, V] float32 probabilities each row samples from (see the module docstring)."""
    if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
        raise ValueError(f"logits of shape {tuple(logits.shape)} do not match {batch.num_rows} rows")
    logits = logits.float()
    greedy = batch.greedy_mask
    if batch.all_greedy:
        return _one_hot_argmax(logits)
    # Greedy rows go through the same arithmetic with temperature 1 and are overwritten below,
    # which keeps the common mixed batch free of row gathers.
    temperature = torch.where(greedy, torch.ones_like(batch.temperature), batch.temperature)
    scaled = logits / temperature.unsqueeze(1)
    scaled = _apply_top_k_top_p(scaled, batch.top_k, batch.top_p)
    scaled = _apply_min_p(scaled, batch.min_p)
    probs = scaled.softmax(dim=-1)
    if not batch.all_random:
        probs = torch.where(greedy.unsqueeze(1), _one_hot_argmax(logits), probs)
    return probs


def _one_hot_argmax(logits: Tensor) -> Tensor:
    # argmax_rows returns the first maximal index, as torch.argmax does: ties go to the lowest token id.
    probs = torch.zeros_like(logits)
    probs.scatter_(1, argmax_rows(logits).unsqueeze(1), 1.0)
    return probs


def _apply_top_k_top_p(logits: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """Mask (to -inf) logits outside each row's top-k set and then outside its top-p nucleus."""
    vocab_size = logits.shape[-1]
    k_active = (top_k > 0) & (top_k < vocab_size)
    use_k = bool(k_active.any())
    use_p = bool((top_p < 1.0).any())
    if not use_k and not use_p:
        return logits
    if not use_p:
        # The k-th largest value per row is the threshold; values tied with it survive. Rows
        # without top-k get a -inf threshold, so topk never has to look past the largest k.
        k = torch.where(k_active, top_k, 1)
        kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1).unsqueeze(1))
        kth = kth.masked_fill(~k_active.unsqueeze(1), float("-inf"))
        return logits.masked_fill(logits < kth, float("-inf"))
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    if use_k:
        k = torch.where(k_active, top_k, vocab_size)
        kth = sorted_logits.gather(1, (vocab_size - k).unsqueeze(1))
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, float("-inf"))
    # Ascending cumulative mass: a token is dropped when everything up to and including it holds
    # at most 1 - top_p, i.e. the tokens above it already reach top_p. The largest always stays.
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1.0 - top_p).unsqueeze(1)
    drop[:, -1] = False
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, sorted_logits)


def _apply_min_p(logits: Tensor, min_p: Tensor) -> Tensor:
    """Mask tokens whose probability is below ``min_p`` times the row's largest probability."""
    if not bool((min_p > 0.0).any()):
        return logits
    probs = logits.softmax(dim=-1)
    threshold = min_p.unsqueeze(1) * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))
