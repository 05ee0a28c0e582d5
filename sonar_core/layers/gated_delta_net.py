"""Qwen3-Next's linear-attention layer (gated DeltaNet), over per-request recurrent states.

Per token, as transformers' ``Qwen3NextGatedDeltaNet`` computes it:

1. one projection gives, per key head, its query and key, the values and output gates ``z`` of the
   value heads it serves, and per value head a write strength ``b`` and a decay input ``a``
   (the checkpoint's ``in_proj_qkvz`` and ``in_proj_ba``, fused into ``in_proj``);
2. queries, keys and values (in that channel order) go through a depthwise causal convolution of
   ``conv_kernel`` taps and SiLU;
3. queries and keys are L2-normalised (queries also scaled by ``head_k_dim ** -0.5``) and each key
   head serves ``num_v_heads // num_k_heads`` consecutive value heads; ``beta = sigmoid(b)``,
   ``g = -exp(A_log) * softplus(a + dt_bias)``;
4. the gated delta rule (:mod:`sonar_core.layers.delta_rule`) gives one output per value head,
   ``GatedRMSNorm(out, z)`` per head, then ``out_proj``.

The layer keeps no KV cache: its state per request is the convolution's last ``conv_kernel - 1``
inputs and a ``[head_k_dim, head_v_dim]`` matrix per value head (:meth:`GatedDeltaNetConfig.state_spec`),
read and written through the step's :class:`~sonar_core.layers.recurrent_batch.RecurrentBatch`.

Split over tensor-parallel ranks (:meth:`GatedDeltaNetConfig.shard`), a rank keeps whole key heads
with the value heads they serve: its rows of the projections, its channels of the convolution,
its ``A_log``/``dt_bias`` entries and its share of the state; the output norm (one per head
width) stays whole and ``out_proj`` is row-parallel, the layer's one all-reduce. Heads never mix
before ``out_proj``, so nothing else crosses ranks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sonar_core.kv import StateLayerSpec
from sonar_core.layers.decoder import ACTIVATIONS
from sonar_core.layers.delta_rule import l2_normalize
from sonar_core.layers.linear import Linear, output_projection
from sonar_core.layers.norms import GatedRMSNorm
from sonar_core.layers.recurrent_batch import RecurrentBatch
from sonar_core.layers.tensor_parallel import TensorParallel


@dataclass(frozen=True)
class GatedDeltaNetConfig:
    """Shape of one linear-attention layer."""

    hidden_size: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    conv_kernel: int
    rms_norm_eps: float
    hidden_act: str = "silu"

    def __post_init__(self) -> None:
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(
                f"linear attention: linear_num_value_heads ({self.num_v_heads}) must be a multiple of "
                f"linear_num_key_heads ({self.num_k_heads})"
            )
        if self.conv_kernel < 2:
            raise ValueError(
                f"linear attention: linear_conv_kernel_dim must be at least 2, got {self.conv_kernel}"
            )
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(
                f"activation {self.hidden_act!r} is not supported (supported: {', '.join(ACTIVATIONS)})"
            )

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> GatedDeltaNetConfig:
        return cls(
            hidden_size=int(hf_config.hidden_size),
            num_k_heads=int(hf_config.linear_num_key_heads),
            num_v_heads=int(hf_config.linear_num_value_heads),
            head_k_dim=int(hf_config.linear_key_head_dim),
            head_v_dim=int(hf_config.linear_value_head_dim),
            conv_kernel=int(hf_config.linear_conv_kernel_dim),
            rms_norm_eps=float(hf_config.rms_norm_eps),
            hidden_act=hf_config.hidden_act,
        )

    def shard(self, parallel: TensorParallel) -> GatedDeltaNetConfig:
        """The layer one rank builds: its share of the key heads and of the value heads they serve."""
        return parallel.split_fields(self, "num_k_heads", "num_v_heads")

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the convolution: queries, keys and values."""
        return 2 * self.key_dim + self.value_dim

    @property
    def qkvz_rows(self) -> int:
        return 2 * self.key_dim + 2 * self.value_dim

    def state_spec(self) -> StateLayerSpec:
        return StateLayerSpec(
            conv_shape=(self.conv_dim, self.conv_kernel - 1),
            recurrent_shape=(self.num_v_heads, self.head_k_dim, self.head_v_dim),
        )

    def fused_projections(self, prefix: str = "linear_attn.") -> dict[str, tuple[str, int, int]]:
        """``in_proj_qkvz`` and ``in_proj_ba`` stacked into ``in_proj``."""
        rows = self.qkvz_rows
        return {
            f"{prefix}in_proj_qkvz": (f"{prefix}in_proj", 0, rows),
            f"{prefix}in_proj_ba": (f"{prefix}in_proj", rows, rows + 2 * self.num_v_heads),
        }


class GatedDeltaNet(nn.Module):
    """The linear-attention token mixer (see the module docstring). ``state_index`` is the layer's
    place among the model's recurrent layers, i.e. its entry of ``state_specs()``."""

    def __init__(self, config: GatedDeltaNetConfig, state_index: int) -> None:
        super().__init__()
        self.config = config
        self.state_index = state_index
        self.in_proj = Linear(config.hidden_size, config.qkvz_rows + 2 * config.num_v_heads, bias=False)
        # Only its weight ([conv_dim, 1, kernel], the checkpoint's) is used: the convolution runs
        # over each row's state window (RecurrentBatch.convolve).
        self.conv1d = nn.Conv1d(
            config.conv_dim, config.conv_dim, config.conv_kernel, groups=config.conv_dim, bias=False
        )
        self.dt_bias = nn.Parameter(torch.ones(config.num_v_heads))
        self.A_log = nn.Parameter(torch.zeros(config.num_v_heads))
        self.norm = GatedRMSNorm(config.head_v_dim, config.rms_norm_eps)
        self.out_proj = output_projection(config.value_dim, config.hidden_size, bias=False)
        self.act = ACTIVATIONS[config.hidden_act]

    def forward(self, hidden: torch.Tensor, batch: RecurrentBatch) -> torch.Tensor:
        """``hidden`` ``[T, hidden_size]`` -> ``[T, hidden_size]``; reads and writes the rows'
        states of this layer as ``batch`` says."""
        config = self.config
        tokens = hidden.shape[0]
        k_heads, v_heads = config.num_k_heads, config.num_v_heads
        k_dim, v_dim = config.head_k_dim, config.head_v_dim
        per_key_head = v_heads // k_heads
        qkvz, ba = self.in_proj(hidden).split([config.qkvz_rows, 2 * v_heads], dim=-1)
        # The checkpoint groups the projections by key head: [q, k, v..., z...] per key head.
        widths = [k_dim, k_dim, per_key_head * v_dim, per_key_head * v_dim]
        q, k, v, z = qkvz.view(tokens, k_heads, -1).split(widths, dim=-1)
        b, a = ba.view(tokens, k_heads, -1).split([per_key_head, per_key_head], dim=-1)

        state = batch.layer_state(self.state_index)
        mixed = torch.cat((q.reshape(tokens, -1), k.reshape(tokens, -1), v.reshape(tokens, -1)), dim=-1)
        mixed = batch.convolve(mixed, self.conv1d.weight[:, 0], state, self.act)
        q, k, v = mixed.split([config.key_dim, config.key_dim, config.value_dim], dim=-1)
        q = l2_normalize(q.view(tokens, k_heads, k_dim).float()) * k_dim**-0.5
        k = l2_normalize(k.view(tokens, k_heads, k_dim).float())
        if per_key_head > 1:
            q, k = q.repeat_interleave(per_key_head, dim=1), k.repeat_interleave(per_key_head, dim=1)
        beta = b.reshape(tokens, v_heads).sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.reshape(tokens, v_heads).float() + self.dt_bias.float())
        out = batch.gated_delta_rule(q, k, v.reshape(tokens, v_heads, v_dim).float(), g, beta, state)
        out = self.norm(out.to(hidden.dtype), z.reshape(tokens, v_heads, v_dim))
        return self.out_proj(out.reshape(tokens, config.value_dim))
