"""Rejection sampling of drafted tokens against the target model.

Vocabulary (as in vLLM): for a request with k drafts the target scores k + 1 rows, one per draft
position and one after the last draft. The sampler emits

* accepted tokens: the longest prefix of drafts that passes the acceptance test,
* then exactly one more token: a recovered token, sampled at the first rejected position from
  the residual distribution, or, when every draft was accepted, a bonus token sampled from the
  last (bonus) row.

So a request emits between 1 and k + 1 tokens per step, and the emitted sequence is distributed
exactly as if the target had sampled token by token (speculative sampling, Leviathan et al. 2023;
Chen et al. 2023):

    p = target distribution at a position (``processed_probs``: temperature, top-k, top-p, min-p)
    q = draft distribution at that position (one-hot at the draft when no probabilities are given)
    x ~ q is the draft
    accept x with probability min(1, p(x) / q(x))
    on rejection emit y ~ normalize(max(p - q, 0))    (the residual; p if it has no mass)

    P(emit y) = q(y) min(1, p(y)/q(y)) + P(reject) * residual(y)
              = min(p(y), q(y)) + (1 - sum_v min(p(v), q(v))) * max(p(y) - q(y), 0) / Z
    and Z = sum_v max(p(v) - q(v), 0) = 1 - sum_v min(p(v), q(v)), so P(emit y) = p(y).

Greedy rows are the same walk with p one-hot at the argmax (what ``processed_probs`` returns for
temperature 0) and the noise pinned: a draft is accepted iff it is the target's argmax, and the
emitted token is the argmax. No randomness is consumed for them.

Randomness. Every random request draws, from its own generator when it has one, first k uniforms
(one acceptance test per draft), then one row of V exponential race weights (see
``sonar_core.sample.sampler``). One row suffices because exactly one token per request is
sampled from a distribution: the recovered token or the bonus token. A request without drafts
therefore consumes exactly what the plain sampler consumes and samples the same token. The draws
happen in torch before verification, so the torch reference and the Triton kernel see identical
numbers and return identical tokens.
"""

from __future__ import annotations

import importlib.util
import itertools
from dataclasses import dataclass

import torch
from torch import Tensor

from sonar_core.sample.greedy import argmax_rows
from sonar_core.sample.processing import SamplingBatch, processed_probs
from sonar_core.sample.sampler import draw_race_weights

# Fills the output matrix past each request's emitted tokens.
PLACEHOLDER_TOKEN_ID = -1

BACKENDS = ("auto", "torch", "triton")


@dataclass
class SpecDecodeMetadata:
    """Where each request's drafts and target rows live in the flat verification batch."""

    draft_token_ids: Tensor  # [num_draft_tokens] int64, drafts of all requests concatenated
    num_draft_tokens: list[int]  # [B] drafts per request (0 allowed)
    cu_num_draft_tokens: Tensor  # [B] int64, inclusive cumulative sum of num_draft_tokens
    target_logits_indices: Tensor  # [num_draft_tokens] int64, target_logits row scoring each draft
    bonus_logits_indices: Tensor  # [B] int64, target_logits row of each request's bonus token
    max_spec_len: int  # max(num_draft_tokens), 0 for an empty batch

    @classmethod
    def from_drafts(cls, draft_token_ids: list[list[int]], device: torch.device | str) -> SpecDecodeMetadata:
        """Metadata for requests whose target rows are laid out as k_i draft rows then one bonus row."""
        counts = [len(tokens) for tokens in draft_token_ids]
        flat = [token for tokens in draft_token_ids for token in tokens]
        target_rows: list[int] = []
        bonus_rows: list[int] = []
        row = 0
        for count in counts:
            target_rows.extend(range(row, row + count))
            row += count
            bonus_rows.append(row)
            row += 1
        cumulative = torch.tensor(counts, dtype=torch.int64).cumsum(0)
        return cls(
            draft_token_ids=torch.tensor(flat, dtype=torch.int64, device=device),
            num_draft_tokens=counts,
            cu_num_draft_tokens=cumulative.to(device),
            target_logits_indices=torch.tensor(target_rows, dtype=torch.int64, device=device),
            bonus_logits_indices=torch.tensor(bonus_rows, dtype=torch.int64, device=device),
            max_spec_len=max(counts, default=0),
        )

    @property
    def num_requests(self) -> int:
        return len(self.num_draft_tokens)

    @property
    def total_draft_tokens(self) -> int:
        return sum(self.num_draft_tokens)


@dataclass
class RejectionOutput:
    """Tokens each request emits this step."""

    output_token_ids: list[list[int]]  # per request: accepted drafts + one recovered-or-bonus token
    num_accepted: list[int]  # per request: accepted draft tokens (0..k_i)


def rejection_sample(
    target_logits: Tensor,
    metadata: SpecDecodeMetadata,
    draft_probs: Tensor | None,
    sampling: SamplingBatch,
    backend: str = "auto",
) -> RejectionOutput:
    """Verify every request's drafts and emit its accepted prefix plus one sampled token.

    ``target_logits`` is [num_draft_tokens + B, V]: for request i, k_i rows for its draft
    positions then its bonus row, requests in order. ``draft_probs`` is [num_draft_tokens, V] or
    None (drafts treated as one-hot). ``sampling`` has one row per request. ``backend`` is
    "torch", "triton" or "auto" (Triton for CUDA tensors when it is installed, torch otherwise).
    """
    _validate(target_logits, metadata, draft_probs, sampling)
    backend = _resolve_backend(backend, target_logits.device)
    if metadata.num_requests == 0:
        return RejectionOutput(output_token_ids=[], num_accepted=[])
    if sampling.all_greedy:
        return _verify_greedy(target_logits, metadata)
    probs = processed_probs(target_logits, sampling.repeat_rows([k + 1 for k in metadata.num_draft_tokens]))
    # Per generator: the uniforms first, then the race weights (the fixed consumption order).
    uniforms = draw_acceptance_uniforms(sampling, metadata, target_logits.device)
    weights = draw_race_weights(sampling, target_logits.shape[-1], target_logits.device)
    if draft_probs is not None:
        draft_probs = draft_probs.float()
    if backend == "triton":
        from sonar_core.spec_decode.rejection_triton import rejection_verify_triton

        out_tokens, num_accepted = rejection_verify_triton(probs, metadata, draft_probs, uniforms, weights)
    else:
        out_tokens, num_accepted = rejection_verify_torch(probs, metadata, draft_probs, uniforms, weights)
    accepted = num_accepted.tolist()
    rows = out_tokens.tolist()
    return RejectionOutput(
        output_token_ids=[row[: n + 1] for row, n in zip(rows, accepted, strict=True)],
        num_accepted=accepted,
    )


def _verify_greedy(target_logits: Tensor, metadata: SpecDecodeMetadata) -> RejectionOutput:
    """All-greedy batches: accept drafts while they equal the target's argmax, then emit its argmax.

    The same result as the general walk with one-hot target rows and no noise, from one argmax per
    row instead of several [rows, vocab] tensors, since greedy decoding is the common hot path.
    """
    top = argmax_rows(target_logits).tolist()
    drafts = metadata.draft_token_ids.tolist()
    outputs: list[list[int]] = []
    accepted: list[int] = []
    row = draft = 0
    for count in metadata.num_draft_tokens:
        num = 0
        while num < count and drafts[draft + num] == top[row + num]:
            num += 1
        outputs.append(drafts[draft : draft + num] + [top[row + num]])
        accepted.append(num)
        row += count + 1
        draft += count
    return RejectionOutput(output_token_ids=outputs, num_accepted=accepted)


def draw_acceptance_uniforms(
    sampling: SamplingBatch, metadata: SpecDecodeMetadata, device: torch.device | str
) -> Tensor:
    """[num_draft_tokens] float32 U[0, 1) per draft; 0 for greedy requests (no draw).

    Requests without a generator share one batched draw from the default generator; a request
    with a generator draws its k uniforms from it alone, in request order.
    """
    total = metadata.total_draft_tokens
    uniforms = torch.zeros(total, dtype=torch.float32, device=device)
    if total == 0 or sampling.all_greedy:
        return uniforms
    greedy = sampling.greedy_mask.tolist()
    counts = metadata.num_draft_tokens
    rows = zip(sampling.generators, greedy, counts, strict=True)
    if any(g is None and not is_greedy and k > 0 for g, is_greedy, k in rows):
        uniforms.uniform_()
    seeded = [i for i, g in enumerate(sampling.generators) if g is not None and not greedy[i] and counts[i] > 0]
    if seeded:
        starts = [0, *itertools.accumulate(counts)]
        for i in seeded:
            uniforms[starts[i] : starts[i + 1]] = torch.rand(counts[i], generator=sampling.generators[i], device=device)
    if not sampling.all_random:
        repeats = torch.tensor(counts, device=device)
        uniforms.masked_fill_(sampling.greedy_mask.repeat_interleave(repeats), 0.0)
    return uniforms


def rejection_verify_torch(
    probs: Tensor,
    metadata: SpecDecodeMetadata,
    draft_probs: Tensor | None,
    uniforms: Tensor,
    weights: Tensor,
) -> tuple[Tensor, Tensor]:
    """Reference verification with pre-drawn randomness.

    ``probs`` [N + B, V] target distribution per row, ``uniforms`` [N], ``weights`` [B, V].
    Returns ``out_tokens`` [B, max_spec_len + 1] int64 (PLACEHOLDER_TOKEN_ID past the emitted
    tokens) and ``num_accepted`` [B] int64.
    """
    device = probs.device
    num_requests = metadata.num_requests
    counts = torch.tensor(metadata.num_draft_tokens, dtype=torch.int64, device=device)
    starts = metadata.cu_num_draft_tokens - counts
    out_tokens = torch.full(
        (num_requests, metadata.max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=device
    )
    num_accepted = counts.clone()
    draft_ids = metadata.draft_token_ids
    if draft_ids.numel() > 0:
        # Acceptance test: u < p(x) / q(x) written as u * q(x) < p(x). It holds with probability
        # min(1, p(x)/q(x)), never accepts p(x) = 0, and multiplies instead of dividing so that
        # every backend rounds identically.
        p_x = probs[metadata.target_logits_indices].gather(1, draft_ids.unsqueeze(1)).squeeze(1)
        q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs.gather(1, draft_ids.unsqueeze(1)).squeeze(1)
        accepted = uniforms * q_x < p_x
        # Accepted tokens are the prefix before each request's first failed test.
        request = torch.repeat_interleave(torch.arange(num_requests, device=device), counts)
        position = torch.arange(draft_ids.numel(), device=device) - starts[request]
        failed = ~accepted
        num_accepted.scatter_reduce_(0, request[failed], position[failed], reduce="amin")
        keep = position < num_accepted[request]
        out_tokens[request[keep], position[keep]] = draft_ids[keep]
    # The one sampled token: row start + i + a is the first rejected draft's row when a < k, the
    # bonus row when a == k.
    final_rows = starts + torch.arange(num_requests, device=device) + num_accepted
    dist = probs[final_rows]
    rejected = (num_accepted < counts).nonzero().squeeze(1)
    if rejected.numel() > 0:
        draft_rows = starts[rejected] + num_accepted[rejected]
        if draft_probs is None:
            q = torch.nn.functional.one_hot(draft_ids[draft_rows], probs.shape[-1]).to(probs.dtype)
        else:
            q = draft_probs[draft_rows]
        dist[rejected] = residual_distribution(dist[rejected], q)
    final = argmax_rows(dist * weights)
    out_tokens.scatter_(1, num_accepted.unsqueeze(1), final.unsqueeze(1))
    return out_tokens, num_accepted


def residual_distribution(p: Tensor, q: Tensor) -> Tensor:
    """[R, V] unnormalised distribution of recovered tokens: max(p - q, 0) per row.

    Left unnormalised because the race is scale-invariant. A row has no mass only when p <= q
    everywhere, i.e. p == q, where a rejection had probability zero (it happened by rounding);
    p is then the right distribution.
    """
    residual = (p - q).clamp_min(0.0)
    has_mass = (residual > 0).any(dim=-1, keepdim=True)
    return torch.where(has_mass, residual, p)


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"unknown rejection sampler backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" and triton_available() else "torch"
    if backend == "triton" and not triton_available():
        raise RuntimeError("the triton rejection sampler backend needs triton: pip install 'sonar-core[triton]'")
    return backend


def triton_available() -> bool:
    """True when triton can be imported; checked without importing it."""
    return importlib.util.find_spec("triton") is not None


def _validate(
    target_logits: Tensor,
    metadata: SpecDecodeMetadata,
    draft_probs: Tensor | None,
    sampling: SamplingBatch,
) -> None:
    total = metadata.total_draft_tokens
    num_requests = metadata.num_requests
    if target_logits.dim() != 2 or target_logits.shape[0] != total + num_requests:
        raise ValueError(
            f"target_logits has shape {tuple(target_logits.shape)}; expected "
            f"[{total} draft rows + {num_requests} bonus rows, vocab_size]"
        )
    if metadata.draft_token_ids.numel() != total:
        raise ValueError(f"metadata holds {metadata.draft_token_ids.numel()} draft ids but counts sum to {total}")
    if sampling.num_rows != num_requests:
        raise ValueError(f"sampling has {sampling.num_rows} rows for {num_requests} requests")
    vocab_size = target_logits.shape[1]
    if draft_probs is not None and tuple(draft_probs.shape) != (total, vocab_size):
        raise ValueError(f"draft_probs has shape {tuple(draft_probs.shape)}; expected ({total}, {vocab_size})")
    if total > 0:
        low, high = metadata.draft_token_ids.aminmax()
        if int(low) < 0 or int(high) >= vocab_size:
            raise ValueError(f"draft token ids must lie in [0, {vocab_size}); got [{int(low)}, {int(high)}]")
