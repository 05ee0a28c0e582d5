"""Plain-torch reference operations, written from the published formulas, for tests that recompute
a draft head's output from its safetensors by name (no paged cache, no fused projections).

They are deliberately naive (whole sequences, explicit masks, repeated KV heads) so that a test's
reference shares no code path with Sonar's layers.
"""

from __future__ import annotations

import math

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate ``[T, heads, D]`` by the default RoPE rule (halves rotated, Llama/Qwen layout)."""
    half = x.shape[-1] // 2
    inv_freq = 1.0 / theta ** (torch.arange(0, 2 * half, 2, dtype=torch.float32) / (2 * half))
    angles = positions[:, None].float() * inv_freq
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None]
    sin = torch.cat((angles.sin(), angles.sin()), -1)[:, None]
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), -1) * sin


def causal_self_attention(
    w: dict[str, torch.Tensor],
    prefix: str,
    x: torch.Tensor,
    positions: torch.Tensor,
    heads: int,
    kv_heads: int,
    theta: float,
    eps: float = 1e-6,
) -> torch.Tensor:
    """Llama/Qwen2/Qwen3 attention of ``[T, *]`` rows over themselves (causal), from the tensors
    under ``prefix + "self_attn."`` (biases and q/k norms used when present)."""
    p = f"{prefix}self_attn."
    head_dim = w[f"{p}q_proj.weight"].shape[0] // heads

    def project(name: str, count: int) -> torch.Tensor:
        out = x @ w[f"{p}{name}_proj.weight"].T
        bias = w.get(f"{p}{name}_proj.bias")
        out = out + bias if bias is not None else out
        out = out.view(len(x), count, head_dim)
        norm = w.get(f"{p}{name}_norm.weight")
        return rms_norm(out, norm, eps) if norm is not None else out

    q, k, v = project("q", heads), project("k", kv_heads), project("v", kv_heads)
    q, k = rope(q, positions, theta), rope(k, positions, theta)
    group = heads // kv_heads
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(head_dim)
    causal = torch.ones(len(x), len(x), dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    out = torch.einsum("hqk,khd->qhd", probs, v).reshape(len(x), -1)
    return out @ w[f"{p}o_proj.weight"].T


def gated_mlp(w: dict[str, torch.Tensor], prefix: str, x: torch.Tensor) -> torch.Tensor:
    gate, up = x @ w[f"{prefix}mlp.gate_proj.weight"].T, x @ w[f"{prefix}mlp.up_proj.weight"].T
    return (torch.nn.functional.silu(gate) * up) @ w[f"{prefix}mlp.down_proj.weight"].T


def decoder_layer(
    w: dict[str, torch.Tensor],
    prefix: str,
    x: torch.Tensor,
    positions: torch.Tensor,
    heads: int,
    kv_heads: int,
    theta: float,
    eps: float,
) -> torch.Tensor:
    """A pre-norm Llama/Qwen decoder layer over a whole causal sequence."""
    h = rms_norm(x, w[f"{prefix}input_layernorm.weight"], eps)
    x = x + causal_self_attention(w, prefix, h, positions, heads, kv_heads, theta, eps)
    return x + gated_mlp(w, prefix, rms_norm(x, w[f"{prefix}post_attention_layernorm.weight"], eps))
