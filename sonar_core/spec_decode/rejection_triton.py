"""The rejection sampler as one Triton kernel: one program per request walks its drafts.

It implements exactly ``rejection_verify_torch`` (see ``rejection_sampler`` for the math) on the
same pre-drawn uniforms and race weights, with the same floating-point operations (a multiply
and a compare for the acceptance test, subtract/max/multiply for the residual race, argmax with
the lowest index on ties), so both backends return identical tokens for identical inputs.

This module imports triton at import time; ``rejection_sampler`` imports it only when the Triton
backend is chosen, so the engine runs without triton installed. On a machine without a GPU
(triton 3.9), ``import triton`` works, but launching a compiled kernel fails for want of a
driver. The interpreter runs the kernel on CPU tensors instead: set ``TRITON_INTERPRET=1`` in
the environment before triton is first imported in the process. Triton reads the variable when
it decorates functions, its own ``tl`` library included, so setting it after the import is not
enough; the tests therefore run the interpreted kernel in a fresh subprocess.
"""

import os
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl
from torch import Tensor

if TYPE_CHECKING:
    from sonar_core.spec_decode.rejection_sampler import SpecDecodeMetadata

# Vocabulary columns one program handles per iteration of the final-token loop.
_MAX_BLOCK_V = 4096


@triton.jit
def _rejection_kernel(
    out_tokens_ptr,  # [B, out_stride] int64, pre-filled with the placeholder id
    num_accepted_ptr,  # [B] int64
    probs_ptr,  # [N + B, V] float32 target distribution per row
    draft_ids_ptr,  # [N] int64
    draft_probs_ptr,  # [N, V] float32; not read unless HAS_DRAFT_PROBS
    uniforms_ptr,  # [N] float32
    weights_ptr,  # [B, V] float32 race weights 1/E
    cu_num_draft_ptr,  # [B] int64 inclusive cumulative draft counts
    vocab_size,
    out_stride,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    req = tl.program_id(0).to(tl.int64)
    end = tl.load(cu_num_draft_ptr + req)
    start = tl.load(cu_num_draft_ptr + req - 1, mask=req > 0, other=0)
    num_drafts = end - start
    first_row = start + req  # target row of this request's first draft; bonus row = end + req

    # Walk the drafts while they pass: accept x iff u * q(x) < p(x) (probability min(1, p/q)).
    num_accepted = 0
    rejected = 0
    for j in range(num_drafts):
        if rejected == 0:
            token = tl.load(draft_ids_ptr + start + j)
            p_x = tl.load(probs_ptr + (first_row + j) * vocab_size + token)
            if HAS_DRAFT_PROBS:
                q_x = tl.load(draft_probs_ptr + (start + j) * vocab_size + token)
            else:
                q_x = 1.0
            u = tl.load(uniforms_ptr + start + j)
            if u * q_x < p_x:
                tl.store(out_tokens_ptr + req * out_stride + j, token)
                num_accepted += 1
            else:
                rejected = 1

    # One race over the vocabulary picks the final token. On rejection the race runs over the
    # residual max(p - q, 0) of the rejected position (falling back to p when it has no mass);
    # otherwise q is zero and the race runs over p of the bonus row. Both races are tracked in
    # one pass so the fallback needs no second pass.
    use_residual = num_accepted < num_drafts
    row = first_row + num_accepted
    draft_row = start + num_accepted
    rejected_token = tl.load(draft_ids_ptr + draft_row, mask=use_residual, other=-1)
    best_residual_key = -1.0
    best_residual_idx = 0
    best_p_key = -1.0
    best_p_idx = 0
    max_residual = 0.0
    # Columns of the draft row to read: all of them on rejection, none otherwise.
    q_limit = tl.where(use_residual, vocab_size, 0)
    for offset in range(0, vocab_size, BLOCK_V):
        cols = offset + tl.arange(0, BLOCK_V)
        in_vocab = cols < vocab_size
        p = tl.load(probs_ptr + row * vocab_size + cols, mask=in_vocab, other=0.0)
        w = tl.load(weights_ptr + req * vocab_size + cols, mask=in_vocab, other=0.0)
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_probs_ptr + draft_row * vocab_size + cols, mask=cols < q_limit, other=0.0)
        else:
            q = tl.where(cols == rejected_token, 1.0, 0.0)
        residual = tl.maximum(p - q, 0.0)
        max_residual = tl.maximum(max_residual, tl.max(residual, 0))
        residual_key = tl.where(in_vocab, residual * w, -1.0)
        p_key = tl.where(in_vocab, p * w, -1.0)
        block_key, block_idx = tl.max(residual_key, 0, return_indices=True)
        # Strictly greater: on ties the earlier block, i.e. the lower token id, wins.
        if block_key > best_residual_key:
            best_residual_key = block_key
            best_residual_idx = offset + block_idx
        block_key, block_idx = tl.max(p_key, 0, return_indices=True)
        if block_key > best_p_key:
            best_p_key = block_key
            best_p_idx = offset + block_idx
    final_token = tl.where(max_residual > 0.0, best_residual_idx, best_p_idx)
    tl.store(out_tokens_ptr + req * out_stride + num_accepted, final_token)
    tl.store(num_accepted_ptr + req, num_accepted)


def _interpret_mode() -> bool:
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


# Whether the kernel above was wrapped for the interpreter (decided when it was decorated).
_INTERPRETED = _interpret_mode()


def rejection_verify_triton(
    probs: Tensor,
    metadata: "SpecDecodeMetadata",
    draft_probs: Tensor | None,
    uniforms: Tensor,
    weights: Tensor,
) -> tuple[Tensor, Tensor]:
    """Same contract as ``rejection_verify_torch``: (out_tokens [B, max_spec_len + 1], num_accepted [B])."""
    from sonar_core.spec_decode.rejection_sampler import PLACEHOLDER_TOKEN_ID

    if not probs.is_cuda and not _INTERPRETED:
        raise RuntimeError(
            "the Triton rejection sampler needs CUDA tensors; to run it on CPU tensors, set "
            "TRITON_INTERPRET=1 in the environment before triton is imported"
        )
    num_requests = metadata.num_requests
    vocab_size = probs.shape[-1]
    out_tokens = torch.full(
        (num_requests, metadata.max_spec_len + 1), PLACEHOLDER_TOKEN_ID, dtype=torch.int64, device=probs.device
    )
    num_accepted = torch.empty(num_requests, dtype=torch.int64, device=probs.device)
    if num_requests == 0:
        return out_tokens, num_accepted
    probs = probs.float().contiguous()
    draft_ids = metadata.draft_token_ids.contiguous()
    uniforms = uniforms.float().contiguous()
    has_draft_probs = draft_probs is not None and draft_ids.numel() > 0
    if draft_ids.numel() == 0:
        # Nothing reads them without drafts, but some launchers reject the null pointer of an
        # empty tensor, so hand over same-typed tensors that have storage.
        draft_ids, uniforms = metadata.cu_num_draft_tokens.contiguous(), probs
    _rejection_kernel[(num_requests,)](
        out_tokens,
        num_accepted,
        probs,
        draft_ids,
        draft_probs.float().contiguous() if has_draft_probs else probs,
        uniforms,
        weights.float().contiguous(),
        metadata.cu_num_draft_tokens.contiguous(),
        vocab_size,
        out_tokens.stride(0),
        HAS_DRAFT_PROBS=has_draft_probs,
        BLOCK_V=min(triton.next_power_of_2(vocab_size), _MAX_BLOCK_V),
        # Keep every multiply separately rounded, as torch rounds it (the interpreter ignores this).
        enable_fp_fusion=False,
    )
    return out_tokens, num_accepted
