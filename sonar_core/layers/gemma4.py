"""Gemma 4 decoder layers over the paged KV cache: the text decoder's, and a Gemma 4 assistant's.

How they differ from the Llama-style layer of :mod:`sonar_core.layers.decoder`:

- RMSNorm is ``x / rms(x) * w`` computed in float32 with the float32 weight, cast back once
  (:class:`Gemma4RMSNorm`; the value norm has no weight at all).
- Attention normalises q and k per head before RoPE and v per head after the projection; its
  scaling is 1.0 (the norms fix the scale). A ``k_eq_v`` layer projects keys only and uses that
  raw projection as its values too (each then takes its own norm). A ``kv_shared`` layer projects
  queries only and reads the cache an earlier layer of its type wrote: the target's last layers
  when ``num_kv_shared_layers`` is set, every layer of an assistant.
- Sandwich norms: the attention output and the feed-forward output are normed before they join
  the residual stream.
- Optionally a routed mixture of experts beside the dense MLP (``enable_moe_block``), a per-layer
  input (PLE) mixed in after the feed-forward, and a scalar that multiplies the layer's output.

q/k/v and gate/up are fused into one projection each, as in the Llama-style layer;
:func:`gemma4_fused_projections` maps the checkpoint's separate tensors onto them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sonar_core.kv import KVCache
from sonar_core.layers.attention import AttentionMetadata, PagedAttention
from sonar_core.layers.decoder import ACTIVATIONS, DecoderLayerConfig, GatedMLP
from sonar_core.layers.linear import Linear
from sonar_core.layers.rotary import apply_rotary


@dataclass(frozen=True)
class Gemma4MoEConfig:
    """The routed experts beside a layer's dense MLP."""

    num_experts: int
    top_k: int
    intermediate_size: int  # per expert

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts or self.intermediate_size < 1:
            raise ValueError(
                f"enable_moe_block needs 0 < top_k_experts ({self.top_k}) <= num_experts ({self.num_experts}) "
                f"and a positive moe_intermediate_size ({self.intermediate_size})"
            )


@dataclass(frozen=True)
class Gemma4LayerConfig:
    """Shape and switches of one Gemma 4 decoder layer (they vary by layer: sliding and full
    layers differ in head size and KV heads, KV-shared layers may have a wider MLP)."""

    hidden_size: int
    intermediate_size: int  # already doubled where use_double_wide_mlp applies
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    hidden_act: str = "gelu_pytorch_tanh"
    attention_bias: bool = False
    sliding_window: int | None = None  # None: full attention
    k_eq_v: bool = False  # keys and values come from one projection
    kv_shared: bool = False  # query-only: reads the cache of an earlier layer of its type
    per_layer_input_size: int = 0  # hidden_size_per_layer_input; 0 without PLE
    moe: Gemma4MoEConfig | None = None

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"hidden_activation {self.hidden_act!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
            )


class Gemma4RMSNorm(nn.Module):
    """``x / sqrt(mean(x^2) + eps) * weight`` in float32, cast back to the input's dtype at the end
    (Gemma 4's order; :class:`~sonar_core.layers.norms.RMSNorm` casts before the weight).
    ``with_scale=False`` has no weight (the value norm, the router's input norm)."""

    def __init__(self, dim: int, eps: float = 1e-6, with_scale: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim)) if with_scale else None
        self.eps = eps
        self._shape = (dim,)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        return F.rms_norm(x.float(), self._shape, weight, self.eps).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self._shape[0]}, eps={self.eps}, with_scale={self.weight is not None}"


class ScaledEmbedding(nn.Embedding):
    """An embedding multiplied by ``scale`` rounded to the weight's dtype first, as Gemma does
    (``sqrt(3072)`` = 55.43 becomes 55.5 in bfloat16). The weight stays the plain table, so a tied
    LM head shares it."""

    def __init__(self, num_embeddings: int, embedding_dim: int, scale: float) -> None:
        super().__init__(num_embeddings, embedding_dim)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        scale = torch.tensor(self.scale, dtype=torch.float32).to(self.weight.dtype).item()
        return super().forward(input_ids) * scale

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, scale={self.scale:.6g}"


def gemma4_fused_projections(config: Gemma4LayerConfig, prefix: str = "") -> dict[str, tuple[str, int, int]]:
    """Checkpoint module -> (fused module, first row, end row) for one layer whose modules sit under
    ``prefix`` (``"layers.3."``); the prefix keeps layers of different widths apart."""
    q_rows = config.num_heads * config.head_dim
    kv_rows = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    fused = {
        f"{prefix}mlp.gate_proj": (f"{prefix}mlp.gate_up_proj", 0, inter),
        f"{prefix}mlp.up_proj": (f"{prefix}mlp.gate_up_proj", inter, 2 * inter),
    }
    if config.kv_shared:
        return fused
    qkv = f"{prefix}self_attn.qkv_proj"
    fused[f"{prefix}self_attn.q_proj"] = (qkv, 0, q_rows)
    fused[f"{prefix}self_attn.k_proj"] = (qkv, q_rows, q_rows + kv_rows)
    if not config.k_eq_v:
        fused[f"{prefix}self_attn.v_proj"] = (qkv, q_rows + kv_rows, q_rows + 2 * kv_rows)
    return fused


class Gemma4Attention(nn.Module):
    """Gemma 4 self-attention over the paged cache (see the module docstring). A ``kv_shared``
    layer has ``q_proj`` alone; the others fuse q, k (and v unless ``k_eq_v``) into ``qkv_proj``."""

    def __init__(self, config: Gemma4LayerConfig) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.kv_shared = config.kv_shared
        self.k_eq_v = config.k_eq_v
        q_rows = config.num_heads * config.head_dim
        kv_rows = config.num_kv_heads * config.head_dim
        bias = config.attention_bias
        if config.kv_shared:
            self.q_proj = Linear(config.hidden_size, q_rows, bias=bias)
        else:
            kv_projections = 1 if config.k_eq_v else 2
            self.qkv_proj = Linear(config.hidden_size, q_rows + kv_projections * kv_rows, bias=bias)
            self.k_norm = Gemma4RMSNorm(config.head_dim, config.rms_norm_eps)
            self.v_norm = Gemma4RMSNorm(config.head_dim, config.rms_norm_eps, with_scale=False)
        self.q_norm = Gemma4RMSNorm(config.head_dim, config.rms_norm_eps)
        self.o_proj = Linear(q_rows, config.hidden_size, bias=bias)
        self.attn = PagedAttention(
            config.num_heads, config.num_kv_heads, config.head_dim, scale=1.0, sliding_window=config.sliding_window
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``hidden`` ``[T, hidden_size]`` (normed) -> ``[T, hidden_size]``. A ``kv_shared`` layer
        only reads ``kv_cache``; the others write this step's keys and values into it first."""
        tokens, heads, kv_heads, head_dim = hidden.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.kv_shared:
            q = apply_rotary(self.q_norm(self.q_proj(hidden).view(tokens, heads, head_dim)), cos, sin)
            return self.o_proj(self.attn.attend(q, kv_cache, metadata))
        qkv = self.qkv_proj(hidden)
        q_rows, kv_rows = heads * head_dim, kv_heads * head_dim
        q = qkv[:, :q_rows].view(tokens, heads, head_dim)
        k = qkv[:, q_rows : q_rows + kv_rows].view(tokens, kv_heads, head_dim)
        v = k if self.k_eq_v else qkv[:, q_rows + kv_rows :].view(tokens, kv_heads, head_dim)
        # q and k side by side: one RoPE application rotates both.
        qk = apply_rotary(torch.cat((self.q_norm(q), self.k_norm(k)), dim=1), cos, sin)
        out = self.attn(qk[:, :heads], qk[:, heads:], self.v_norm(v), kv_cache, metadata)
        return self.o_proj(out)


class Gemma4Router(nn.Module):
    """Top-k expert choice: ``softmax(proj(norm(x) * scale / sqrt(hidden)))`` over all experts in
    float32, the k best renormalised to sum 1, each times its expert's ``per_expert_scale``."""

    def __init__(self, hidden_size: int, moe: Gemma4MoEConfig, eps: float) -> None:
        super().__init__()
        self.top_k = moe.top_k
        self.root_size = hidden_size**-0.5
        self.norm = Gemma4RMSNorm(hidden_size, eps, with_scale=False)
        self.proj = Linear(hidden_size, moe.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden_size))
        self.per_expert_scale = nn.Parameter(torch.ones(moe.num_experts))

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[T, hidden]`` -> ``(weights, expert ids)``, each ``[T, top_k]`` (weights float32)."""
        probs = F.softmax(self.proj(self.norm(x) * self.scale * self.root_size), dim=-1, dtype=torch.float32)
        weights, ids = probs.topk(self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[ids], ids


class Gemma4Experts(nn.Module):
    """The routed experts, stored stacked as the checkpoint has them: ``gate_up_proj``
    ``[E, 2 * I, hidden]`` (gate rows first) and ``down_proj`` ``[E, hidden, I]``.

    Only experts that received tokens run: the (token, expert) pairs are sorted by expert once and
    each hit expert multiplies its tokens' rows in one batch.
    """

    def __init__(self, hidden_size: int, moe: Gemma4MoEConfig, hidden_act: str) -> None:
        super().__init__()
        self.intermediate_size = moe.intermediate_size
        self.gate_up_proj = nn.Parameter(torch.empty(moe.num_experts, 2 * moe.intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(moe.num_experts, hidden_size, moe.intermediate_size))
        self.act = ACTIVATIONS[hidden_act]

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, hidden]``, ``weights``/``ids`` ``[T, top_k]`` -> ``[T, hidden]``."""
        per_token = ids.shape[1]
        pairs = ids.reshape(-1)
        order = pairs.argsort(stable=True)
        hit, counts = pairs[order].unique_consecutive(return_counts=True)
        pair_weights = weights.reshape(-1, 1)
        inter = self.intermediate_size
        out = torch.zeros_like(x)
        start = 0
        for expert, count in zip(hit.tolist(), counts.tolist(), strict=True):
            chosen = order[start : start + count]
            start += count
            tokens = chosen // per_token
            gate_up = F.linear(x.index_select(0, tokens), self.gate_up_proj[expert])
            routed = F.linear(self.act(gate_up[:, :inter]) * gate_up[:, inter:], self.down_proj[expert])
            out.index_add_(0, tokens, (routed * pair_weights[chosen]).to(x.dtype))
        return out


class Gemma4DecoderLayer(nn.Module):
    """One Gemma 4 layer; module names follow the checkpoint (``self_attn``, ``mlp``, ``router``,
    ``experts``, the six norms, ``per_layer_input_gate``/``per_layer_projection``, ``layer_scalar``)."""

    def __init__(self, config: Gemma4LayerConfig) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.self_attn = Gemma4Attention(config)
        self.mlp = GatedMLP(
            DecoderLayerConfig(
                hidden_size=hidden,
                intermediate_size=config.intermediate_size,
                num_heads=config.num_heads,
                num_kv_heads=config.num_kv_heads,
                head_dim=config.head_dim,
                hidden_act=config.hidden_act,
            )
        )
        self.input_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_attention_layernorm = Gemma4RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.post_feedforward_layernorm = Gemma4RMSNorm(hidden, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))
        self.has_moe = config.moe is not None
        if config.moe is not None:
            self.router = Gemma4Router(hidden, config.moe, eps)
            self.experts = Gemma4Experts(hidden, config.moe, config.hidden_act)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(hidden, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(hidden, eps)
        self.has_per_layer_input = config.per_layer_input_size > 0
        if self.has_per_layer_input:
            self.act = ACTIVATIONS[config.hidden_act]
            self.per_layer_input_gate = Linear(hidden, config.per_layer_input_size, bias=False)
            self.per_layer_projection = Linear(config.per_layer_input_size, hidden, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(hidden, eps)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
        per_layer_input: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """``hidden`` ``[T, hidden_size]`` -> the layer's output; ``per_layer_input``
        ``[T, per_layer_input_size]`` is required exactly when the layer has PLE."""
        if self.has_per_layer_input != (per_layer_input is not None):
            raise ValueError(
                "this Gemma 4 layer "
                + ("needs its per-layer input" if self.has_per_layer_input else "has no per-layer input")
            )
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, metadata)
        hidden = hidden + self.post_attention_layernorm(attn)
        feed_forward = self.mlp(self.pre_feedforward_layernorm(hidden))
        if self.has_moe:
            # The router and the experts read the residual stream itself, beside the dense MLP.
            weights, ids = self.router(hidden)
            routed = self.experts(self.pre_feedforward_layernorm_2(hidden), weights, ids)
            feed_forward = self.post_feedforward_layernorm_1(feed_forward) + self.post_feedforward_layernorm_2(routed)
        hidden = hidden + self.post_feedforward_layernorm(feed_forward)
        if per_layer_input is not None:
            gated = self.act(self.per_layer_input_gate(hidden)) * per_layer_input
            hidden = hidden + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return hidden * self.layer_scalar
