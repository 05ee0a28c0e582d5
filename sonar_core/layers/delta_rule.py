"""The gated delta rule, the recurrence of Qwen3-Next's linear attention, in two equivalent forms.

Per value head, with a state ``S`` ``[k_dim, v_dim]`` and per token ``q, k`` (L2-normalised, ``q``
also scaled by ``k_dim ** -0.5``), ``v``, a log-decay ``g <= 0`` and a write strength ``beta``::

    S = exp(g) * S                        forget
    S = S + k (beta * (v - S^T k))^T      replace what S predicts for k by v (the delta rule)
    o = S^T q

:func:`recurrent_gated_delta_rule` runs that token by token, over a batch of rows at once, and
returns the state after every token (what a verification step keeps for rollback).
:func:`chunked_gated_delta_rule` computes the same for one long row with a few large matmuls per
chunk of tokens: inside a chunk the updates are folded into one unit lower-triangular solve (the
WY/UT form of the DeltaNet papers), and only the chunk-to-chunk state is sequential.

Everything here is float32: the state accumulates over the whole sequence.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dimension (the reference's epsilon placement)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The rule token by token for ``B`` rows of ``L`` tokens.

    ``q``/``k`` ``[B, L, H, Dk]``, ``v`` ``[B, L, H, Dv]``, ``g``/``beta`` ``[B, L, H]``, ``state``
    ``[B, H, Dk, Dv]`` (the state before the first token). Returns the outputs ``[B, L, H, Dv]`` and
    the state after each of the ``L`` tokens. A token with ``g = 0`` and ``beta = 0`` leaves the
    state as it is, so shorter rows padded that way at the end keep their final state.
    """
    outputs, states = [], []
    for t in range(q.shape[1]):
        q_t, k_t = q[:, t, :, None, :], k[:, t, :, None, :]  # [B, H, 1, Dk]
        state = state * g[:, t, :, None, None].exp()
        delta = (v[:, t] - (k_t @ state).squeeze(2)) * beta[:, t, :, None]  # [B, H, Dv]
        state = state + k_t.transpose(-1, -2) * delta[:, :, None, :]
        outputs.append((q_t @ state).squeeze(2))
        states.append(state)
    return torch.stack(outputs, dim=1), states


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rule for one row of ``L`` tokens, ``chunk_size`` tokens at a time.

    ``q``/``k`` ``[L, H, Dk]``, ``v`` ``[L, H, Dv]``, ``g``/``beta`` ``[L, H]``, ``state``
    ``[H, Dk, Dv]``. Returns the outputs ``[L, H, Dv]`` and the final state.

    Within a chunk starting from ``S0``, with ``G_t`` the cumulative log-decay up to token ``t``,
    the state before token ``t`` reads ``exp(G_t) S0`` plus the decayed writes of the chunk's
    earlier tokens, so the writes ``D`` solve ``(I + A) D = beta V - beta exp(G) K S0`` with
    ``A[t, i] = beta_t (k_t . k_i) exp(G_t - G_i)`` for ``i < t``. The outputs are
    ``exp(G) Q S0 + (Q K^T * decay) D`` and the state after the chunk
    ``exp(G_end) S0 + (K exp(G_end - G))^T D``.
    """
    length, heads = q.shape[:2]
    chunk = min(chunk_size, length)
    pad = -length % chunk
    num_chunks = (length + pad) // chunk

    def chunked(x: torch.Tensor) -> torch.Tensor:
        """``[L, H, ...]`` -> ``[H, N, C, ...]``, zero-padded at the end: a padded token has
        ``beta = 0`` and ``g = 0``, so it neither writes nor decays."""
        x = x.transpose(0, 1)
        if pad:
            x = F.pad(x, (0, 0, 0, pad) if x.dim() == 3 else (0, pad))
        return x.reshape(heads, num_chunks, chunk, *x.shape[2:])

    q, k, v, g, beta = (chunked(x) for x in (q, k, v, g, beta))
    decay = g.cumsum(dim=-1)  # [H, N, C]: G_t
    causal = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    # exp(G_t - G_i) for i <= t, 0 above the diagonal (masked before exp: those exponents are > 0).
    pairwise = (decay[..., :, None] - decay[..., None, :]).masked_fill(~causal, float("-inf")).exp()
    k_beta = k * beta[..., None]
    # The diagonal of the system is ignored (unitriangular), the upper triangle is zero.
    system = (k_beta @ k.transpose(-1, -2)) * pairwise
    rhs = torch.cat((v * beta[..., None], k_beta * decay.exp()[..., None]), dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    values, decayed_keys = solved.split([v.shape[-1], k.shape[-1]], dim=-1)
    scores = (q @ k.transpose(-1, -2)) * pairwise
    q_decayed = q * decay.exp()[..., None]
    k_to_end = (k * (decay[..., -1:] - decay).exp()[..., None]).transpose(-1, -2)
    chunk_decay = decay[..., -1].exp()[..., None, None]  # [H, N, 1, 1]

    outputs = []
    for n in range(num_chunks):
        writes = values[:, n] - decayed_keys[:, n] @ state  # [H, C, Dv]
        outputs.append(q_decayed[:, n] @ state + scores[:, n] @ writes)
        state = state * chunk_decay[:, n] + k_to_end[:, n] @ writes
    out = torch.cat(outputs, dim=1)[:, :length]  # [H, L, Dv]
    return out.transpose(0, 1), state
