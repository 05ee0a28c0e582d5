"""Plain decoder layers run as direct calls of Sonar's CPU kernels, without module calls.

Why: a decode step of a small model is about ten kernel calls per layer whose arithmetic waits on
memory, and the module path wraps each in Python (``nn.Module`` calls, attribute lookups, the
checks of which kernel applies, views). Replaying one SmolLM2 decode step (one request, bfloat16,
2 threads) took 23.8 ms through the modules and 18.8 ms as the direct calls below, about what its
matmuls alone took. The layers that qualify (:meth:`DirectLayer.of`: the pre-norm layer of Llama,
Qwen2, Qwen3 and MiMo, SiLU, no output gate, on one rank) take the same kernels with the same
arguments in the same order as their modules would, so the output is the same bits; a
step or layer the kernels do not take (autograd, a dtype or row count they are not built for, a
weight not packed for them, attention not in place) runs its module instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sonar_core import cpu_kernels
from sonar_core.kv import KVCache
from sonar_core.layers.attention import AttentionMetadata, PagedAttention, attends_in_place
from sonar_core.layers.decoder import DecoderLayer
from sonar_core.layers.linear import Linear
from sonar_core.layers.norms import RMSNorm


@dataclass(frozen=True)
class DirectLayer:
    """What one plain decoder layer's kernel calls read: its modules (their weights are read at
    each call, so loading or repacking needs no rebuild) and its attention shape."""

    module: DecoderLayer
    input_norm: RMSNorm
    qkv: Linear
    # Qwen3's per-head norms of q and k (their modules run them, as in the module path).
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    o: Linear
    post_norm: RMSNorm
    gate_up: Linear
    down: Linear
    num_heads: int
    qk_heads: int
    qk_rows: int
    num_kv_heads: int
    head_dim: int
    attention: PagedAttention

    @classmethod
    def of(cls, layer: Any) -> DirectLayer | None:
        """The direct form of ``layer``, or None for a layer the kernels cannot run alone."""
        if type(layer) is not DecoderLayer:
            return None
        attn, mlp = layer.self_attn, layer.mlp
        linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
        norms = (layer.input_layernorm, layer.post_attention_layernorm)
        if (
            attn.output_gate
            or mlp.act is not F.silu
            or any(type(linear) is not Linear for linear in linears)
            or any(type(norm) is not RMSNorm for norm in norms)
        ):
            return None
        return cls(
            module=layer,
            input_norm=layer.input_layernorm,
            qkv=attn.qkv_proj,
            q_norm=attn.q_norm if attn.qk_norm else None,
            k_norm=attn.k_norm if attn.qk_norm else None,
            o=attn.o_proj,
            post_norm=layer.post_attention_layernorm,
            gate_up=mlp.gate_up_proj,
            down=mlp.down_proj,
            num_heads=attn.num_heads,
            qk_heads=attn.qk_heads,
            qk_rows=attn.q_rows + attn.kv_rows,
            num_kv_heads=attn.num_kv_heads,
            head_dim=attn.head_dim,
            attention=attn.attn,
        )

    def takes(self, hidden: torch.Tensor, kv_cache: KVCache) -> bool:
        """Whether every call of this layer takes the kernel for ``hidden``, as its modules would
        decide."""
        rows, dtype = hidden.shape[0], hidden.dtype
        return (
            all(linear.skinny_for(rows, dtype) is not None for linear in (self.qkv, self.o, self.gate_up, self.down))
            and self.input_norm.weight.dtype == dtype
            and self.post_norm.weight.dtype == dtype
            and kv_cache[0].dtype == dtype
        )

    def forward(
        self,
        ops: Any,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        signed_sin: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """The layer's output for ``hidden`` ``[T, hidden_size]`` (contiguous); ``cos`` and
        ``signed_sin`` are the step's rotary tables as ``[T, rotary_dim]``."""
        tokens = hidden.shape[0]
        k_cache, v_cache = kv_cache
        normed = ops.rms_norm(hidden, self.input_norm.weight, self.input_norm.eps)
        qkv = ops.skinny_linear(normed, self.qkv.skinny_weight, self.qkv.bias, self.qkv.out_features)
        qk = qkv[:, : self.qk_rows].view(tokens, self.qk_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1)
        ops.rotary_embedding_(qk, cos, signed_sin)
        v = qkv[:, self.qk_rows :].view(tokens, self.num_kv_heads, self.head_dim)
        ops.store_kv_(qk[:, self.num_heads :], v, k_cache, v_cache, metadata.slot_mapping)
        attended = self.attention.attend_in_place(ops, qk[:, : self.num_heads], kv_cache, metadata)
        out = ops.skinny_linear(attended, self.o.skinny_weight, self.o.bias, self.o.out_features)
        normed, hidden = ops.add_rms_norm(out, hidden, self.post_norm.weight, self.post_norm.eps)
        gate_up = ops.skinny_linear(normed, self.gate_up.skinny_weight, self.gate_up.bias, self.gate_up.out_features)
        down = ops.skinny_linear(ops.silu_and_mul(gate_up), self.down.skinny_weight, self.down.bias, self.down.out_features)
        return hidden + down


def run_layers(
    layers: Sequence[nn.Module],
    direct: Sequence[DirectLayer | None],
    hidden: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    kv_caches: Sequence[KVCache],
    metadata: AttentionMetadata,
    record: Callable[[int, torch.Tensor], None] | None,
) -> torch.Tensor:
    """Run ``layers`` in turn (``direct[i]``: layer i's direct form, or None), each directly where
    the kernels take it and through its module otherwise; ``cos``/``signed_sin`` are the step's
    ``[T, 1, rotary_dim]`` tables. ``record(k, state)`` gets the state after each ``k`` layers (a
    hidden-state capture's)."""
    ops = _kernels_for(hidden, metadata)
    if ops is not None:
        tokens = cos.shape[0]
        flat_cos, flat_sin = cos.reshape(tokens, -1), signed_sin.reshape(tokens, -1)
    for index, layer in enumerate(layers):
        plan = direct[index]
        if ops is not None and plan is not None and plan.module is layer and plan.takes(hidden, kv_caches[index]):
            hidden = plan.forward(ops, hidden, flat_cos, flat_sin, kv_caches[index], metadata)
        else:
            hidden = layer(hidden, cos, signed_sin, kv_caches[index], metadata)
        if record is not None:
            record(index + 1, hidden)
    return hidden


class _Switch:
    """Blocks that run every layer through its modules (:func:`through_modules`)."""

    off = 0


@contextlib.contextmanager
def through_modules() -> Iterator[None]:
    """Run every layer through its modules inside the block (the step benchmark times both)."""
    _Switch.off += 1
    try:
        yield
    finally:
        _Switch.off -= 1


def _kernels_for(hidden: torch.Tensor, metadata: AttentionMetadata) -> Any:
    """The kernels when this step's layers may run directly: inference (no autograd), a
    contiguous ``[T, hidden]`` CPU input of a dtype the matmul kernel packs, attention in place."""
    if _Switch.off or torch.is_grad_enabled() or hidden.dim() != 2 or not hidden.is_contiguous():
        return None
    if hidden.dtype not in cpu_kernels.SKINNY_DTYPES or not attends_in_place(metadata):
        return None
    return cpu_kernels.for_tensor(hidden)
