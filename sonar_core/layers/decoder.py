"""The pre-norm decoder layer shared by the Llama, Qwen2 and Qwen3 families (and by draft heads).

The families differ only in switches of :class:`DecoderLayerConfig` (biases, per-head q/k norms;
Qwen3-Next's full-attention layers add an output gate and zero-centred q/k norms).
Projections that read the same input are fused into one matmul (q/k/v into ``qkv_proj``, gate/up
into ``gate_up_proj``): at batch 1 on a CPU a step is a chain of small matmuls whose fixed cost
dominates, so fewer, larger ones are faster. :func:`fused_projections` tells the weight loader how
the checkpoint's separate tensors stack into them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from sonar_core import cpu_kernels
from sonar_core.kv import KVCache
from sonar_core.layers.attention import AttentionMetadata, PagedAttention
from sonar_core.layers.linear import Linear, output_projection
from sonar_core.layers.norms import RMSNorm, ZeroCentredRMSNorm
from sonar_core.layers.rotary import rotate_

ACTIVATIONS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


@dataclass(frozen=True)
class DecoderLayerConfig:
    """Shape and switches of one decoder layer."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias sets this and o_bias
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: RMSNorm over each head of q and k, before RoPE
    hidden_act: str = "silu"
    # Sliding-window layers (Qwen2/Qwen3 layer_types): keys this many positions behind are masked.
    sliding_window: int | None = None
    # Qwen3-Next: q_proj also yields a gate per query head (per head, head_dim query rows then
    # head_dim gate rows); the attention output is multiplied by sigmoid(gate) before o_proj.
    attn_output_gate: bool = False
    # Qwen3-Next: the q/k norms scale by 1 + weight (ZeroCentredRMSNorm).
    zero_centred_qk_norm: bool = False

    def __post_init__(self) -> None:
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"activation {self.hidden_act!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
            )


def fused_projections(config: DecoderLayerConfig) -> dict[str, tuple[str, int, int]]:
    """Checkpoint module name -> (fused module name, first row, end row) inside a decoder layer."""
    q_rows = config.num_heads * config.head_dim * (2 if config.attn_output_gate else 1)
    kv_rows = config.num_kv_heads * config.head_dim
    inter = config.intermediate_size
    return {
        "self_attn.q_proj": ("self_attn.qkv_proj", 0, q_rows),
        "self_attn.k_proj": ("self_attn.qkv_proj", q_rows, q_rows + kv_rows),
        "self_attn.v_proj": ("self_attn.qkv_proj", q_rows + kv_rows, q_rows + 2 * kv_rows),
        "mlp.gate_proj": ("mlp.gate_up_proj", 0, inter),
        "mlp.up_proj": ("mlp.gate_up_proj", inter, 2 * inter),
    }


class SelfAttention(nn.Module):
    """Fused q/k/v projection, optional per-head q/k norms, RoPE, paged attention, optional output
    gate, output projection.

    ``input_size`` (default: the hidden size) is the width q/k/v read; a draft layer that attends
    over a concatenation (EAGLE-3's first layer reads embedding and hidden state side by side)
    sets it, while the output keeps the hidden size.
    """

    def __init__(self, config: DecoderLayerConfig, input_size: int | None = None) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.qk_heads = config.num_heads + config.num_kv_heads
        self.output_gate = config.attn_output_gate
        self.q_rows = config.num_heads * config.head_dim * (2 if self.output_gate else 1)
        self.kv_rows = config.num_kv_heads * config.head_dim
        qkv_rows = self.q_rows + 2 * self.kv_rows
        self.qkv_proj = Linear(input_size or config.hidden_size, qkv_rows, bias=config.qkv_bias)
        self.o_proj = output_projection(config.num_heads * config.head_dim, config.hidden_size, bias=config.o_bias)
        self.qk_norm = config.qk_norm
        if config.qk_norm:
            norm = ZeroCentredRMSNorm if config.zero_centred_qk_norm else RMSNorm
            self.q_norm = norm(config.head_dim, config.rms_norm_eps)
            self.k_norm = norm(config.head_dim, config.rms_norm_eps)
        self.attn = PagedAttention(
            config.num_heads, config.num_kv_heads, config.head_dim, sliding_window=config.sliding_window
        )

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        q, k, v, gate = self._project(hidden, cos, sin)
        out = self.attn(q, k, v, kv_cache, metadata)
        if gate is not None:
            out = out * torch.sigmoid(gate.reshape(out.shape))
        return self.o_proj(out)

    def store_context(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor
    ) -> None:
        """Write the keys and values of ``hidden`` at ``slot_mapping`` without attending: the context
        of a block drafter, which later queries attend to (DFlash, DSpark)."""
        _, k, v, _ = self._project(hidden, cos, sin)
        self.attn.store(k, v, kv_cache, slot_mapping)

    def _project(
        self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """Rotated (and, with qk_norm, normed) queries and keys, values, per head, and the output
        gate's pre-activation ``[T, num_heads, head_dim]`` (None without an output gate)."""
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        q_rows, kv_rows = self.q_rows, self.kv_rows
        gate = None
        # q and k heads side by side: one RoPE application rotates both.
        if self.output_gate:
            q, gate = qkv[:, :q_rows].view(tokens, self.num_heads, 2, self.head_dim).unbind(2)
            k = qkv[:, q_rows : q_rows + kv_rows].view(tokens, self.num_kv_heads, self.head_dim)
            qk = torch.cat((q, k), dim=1)
        else:
            qk = qkv[:, : q_rows + kv_rows].view(tokens, self.qk_heads, self.head_dim)
        v = qkv[:, q_rows + kv_rows :].view(tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1)
        qk = rotate_(qk, cos, sin)  # qk is this step's own projection (or a copy of it)
        return qk[:, : self.num_heads], qk[:, self.num_heads :], v, gate


class GatedMLP(nn.Module):
    """``down(act(gate(x)) * up(x))`` with gate and up fused.

    ``reduce=False`` keeps ``down`` a plain projection even in a split model: the block then
    returns this rank's partial sum, for a caller that adds several such blocks before one
    all-reduce (the bias-free experts of a :class:`~sonar_core.layers.moe.MoE`).
    """

    def __init__(self, config: DecoderLayerConfig, reduce: bool = True) -> None:
        super().__init__()
        self.intermediate_size = config.intermediate_size
        self.gate_up_proj = Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        down = output_projection if reduce else Linear
        self.down_proj = down(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        kernels = cpu_kernels.for_tensor(gate_up) if self.act is F.silu else None
        if kernels is not None and gate_up.is_contiguous():
            return self.down_proj(kernels.silu_and_mul(gate_up))
        inter = self.intermediate_size
        return self.down_proj(self.act(gate_up[:, :inter]) * gate_up[:, inter:])


class DecoderLayer(nn.Module):
    """``h + attn(norm(h))`` then ``h + mlp(norm(h))``."""

    def __init__(self, config: DecoderLayerConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = SelfAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = GatedMLP(config)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``hidden`` ``[T, hidden_size]`` -> the layer's output ``[T, hidden_size]``."""
        attn = self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, metadata)
        normed, hidden = self.post_attention_layernorm.add_and_norm(attn, hidden)
        return hidden + self.mlp(normed)
