"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over the paged KV cache.

Per token ``t`` and head ``h`` (``r = kv_lora_rank``):

- queries: ``q = q_b_proj(norm(q_a_proj(x)))`` (or ``q_proj(x)``), per head ``[q_nope | q_rope]``;
- the latent: ``[c | k_rope] = kv_a_proj_with_mqa(x)``, ``c = norm(c)`` (``r`` wide) and one rotary
  key ``k_rope`` shared by all heads;
- keys and values: ``k_nope_h = W_UK_h c`` and ``v_h = W_UV_h c``, the rows of ``kv_b_proj`` that
  belong to head ``h``; the key of head ``h`` is ``[k_nope_h | rope(k_rope)]``.

**What is cached:** ``[c | rope(k_rope)]``, ``r + qk_rope_head_dim`` values per token and layer (576
for DeepSeek-V3, against 128 heads x (192 + 128) = 40,960 for expanded keys and values). The key
cache of a layer is ``[num_blocks, block_size, 1, r + qk_rope_head_dim]``; its value cache has width
0 (the values are the first ``r`` columns of the same rows).

**How attention is computed: the absorbed form.** ``q_nope_h . W_UK_h c = (W_UK_h^T q_nope_h) . c``
and ``sum_j p_j W_UV_h c_j = W_UV_h (sum_j p_j c_j)``. So each new token's queries are projected into
the latent space once (``[q_nope W_UK | rope(q_rope)]``), attention runs as multi-query attention
with a single key head over the cached latents, and each head's latent output is projected by
``W_UV``. Expanding through ``kv_b_proj`` instead would cost, at every step and in every layer, a
matmul over the *whole context* and per-head keys and values the size MLA exists to avoid; the
absorbed form costs two small per-head matmuls per *new* token, and decode reads only the latents.
Its attention dot products are ``r + rope`` wide instead of ``nope + rope``, which a long prefill
chunk over a short context pays for; at decode, the case a CPU engine lives in, it is much cheaper.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sonar_core.kv import KVCache, KVLayerSpec
from sonar_core.layers.attention import AttentionMetadata
from sonar_core.layers.linear import Linear
from sonar_core.layers.norms import RMSNorm
from sonar_core.layers.rotary import RopeConfig, RotaryEmbedding, apply_rotary
from sonar_core.layers.yarn import (
    YarnRopeConfig,
    rope_config_with_yarn,
    rope_parameters,
    rope_type,
    yarn_mscale,
)

# q_a_layernorm and kv_a_layernorm use this epsilon whatever rms_norm_eps says (as DeepSeek's and
# transformers' implementations build them).
LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLAConfig:
    """Shape of one MLA layer, its rotary embedding and its softmax scale."""

    hidden_size: int
    num_heads: int
    q_lora_rank: int | None  # None: queries come from one q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope: RopeConfig
    softmax_scale: float
    # YaRN scales cos and sin by this factor (1 for other rope types).
    rope_attention_factor: float = 1.0
    # DeepSeek checkpoints pair the rotary dimensions as (0, 1), (2, 3), ... instead of halves.
    rope_interleave: bool = True
    # Bias on q_a_proj, kv_a_proj_with_mqa and o_proj.
    attention_bias: bool = False

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_heads", "kv_lora_rank", "qk_rope_head_dim", "v_head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"MLA: {name} must be positive, got {getattr(self, name)}")
        if self.q_lora_rank is not None and self.q_lora_rank <= 0:
            raise ValueError(f"MLA: q_lora_rank must be positive or null, got {self.q_lora_rank}")
        if self.qk_rope_head_dim % 2:
            raise ValueError(f"MLA: qk_rope_head_dim must be even, got {self.qk_rope_head_dim}")

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> MLAConfig:
        """Read a DeepSeek-V3-style config (``kv_lora_rank``, ``q_lora_rank``, ``qk_*_head_dim``...).

        The softmax scale is ``qk_head_dim ** -0.5``, times ``yarn_mscale(factor, mscale_all_dim)``
        squared for scaled rope types that set ``mscale_all_dim`` (DeepSeek's correction).
        """
        rope_dim = int(hf_config.qk_rope_head_dim)
        head_dim = getattr(hf_config, "head_dim", None)
        if head_dim is not None and head_dim != rope_dim:
            raise ValueError(
                f"{getattr(hf_config, 'model_type', 'MLA')}: head_dim ({head_dim}) must equal qk_rope_head_dim "
                f"({rope_dim}): it is the rotary width; remove head_dim from config.json"
            )
        rope = rope_config_with_yarn(hf_config, rope_dim)
        params = rope_parameters(hf_config)
        nope = int(hf_config.qk_nope_head_dim)
        scale = (nope + rope_dim) ** -0.5
        mscale_all_dim = params.get("mscale_all_dim")
        if rope_type(params) != "default" and mscale_all_dim:
            scale *= yarn_mscale(rope.factor, mscale_all_dim) ** 2
        q_lora_rank = getattr(hf_config, "q_lora_rank", None)
        return cls(
            hidden_size=int(hf_config.hidden_size),
            num_heads=int(hf_config.num_attention_heads),
            q_lora_rank=None if q_lora_rank is None else int(q_lora_rank),
            kv_lora_rank=int(hf_config.kv_lora_rank),
            qk_nope_head_dim=nope,
            qk_rope_head_dim=rope_dim,
            v_head_dim=int(hf_config.v_head_dim),
            rope=rope,
            softmax_scale=scale,
            rope_attention_factor=rope.attention_factor if isinstance(rope, YarnRopeConfig) else 1.0,
            rope_interleave=bool(getattr(hf_config, "rope_interleave", True)),
            attention_bias=bool(getattr(hf_config, "attention_bias", False)),
        )

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_width(self) -> int:
        """Cached values per token: the normed latent and the rotated shared key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    def kv_spec(self) -> KVLayerSpec:
        """One key "head" as wide as the cached latent, no separate values."""
        return KVLayerSpec(num_kv_heads=1, head_dim=self.latent_width, value_head_dim=0)


def mla_fused_projections(config: MLAConfig, prefix: str = "self_attn.") -> dict[str, tuple[str, int, int]]:
    """Checkpoint module -> (fused module, first row, end row): with a query LoRA, ``q_a_proj`` and
    ``kv_a_proj_with_mqa`` both read the layer input and are fused into ``qkv_a_proj``."""
    if config.q_lora_rank is None:
        return {}
    q_rows = config.q_lora_rank
    fused = f"{prefix}qkv_a_proj"
    return {
        f"{prefix}q_a_proj": (fused, 0, q_rows),
        f"{prefix}kv_a_proj_with_mqa": (fused, q_rows, q_rows + config.latent_width),
    }


class MLARotary:
    """The cos/sin tables of the rotary dimensions, computed once per step for every MLA layer
    (the YaRN attention factor applied in float32, before the cast, as transformers does)."""

    def __init__(self, config: MLAConfig) -> None:
        self.rotary = RotaryEmbedding(config.rope)
        self.attention_factor = config.rope_attention_factor

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, upto: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(cos, signed_sin)``, each ``[T, 1, qk_rope_head_dim]``, for :func:`apply_rotary`
        (``upto`` as :meth:`RotaryEmbedding.cos_sin` takes it)."""
        if self.attention_factor == 1.0:
            return self.rotary.cos_sin(positions, dtype, upto)
        cos, sin = self.rotary.cos_sin(positions, torch.float32, upto)
        return (cos * self.attention_factor).to(dtype), (sin * self.attention_factor).to(dtype)


class MultiHeadLatentAttention(nn.Module):
    """MLA with the compressed latent in the paged cache and attention in the absorbed form (see the
    module docstring). Parameter names follow the checkpoint, except ``qkv_a_proj`` (fused, see
    :func:`mla_fused_projections`). ``kv_b_proj`` is never called as a layer: its weight is read as
    the per-head absorption matrices ``W_UK`` and ``W_UV``.
    """

    def __init__(self, config: MLAConfig) -> None:
        super().__init__()
        self.config = config
        heads, qk_rows = config.num_heads, config.num_heads * config.qk_head_dim
        if config.q_lora_rank is None:
            self.q_proj = Linear(config.hidden_size, qk_rows, bias=False)
            self.kv_a_proj_with_mqa = Linear(config.hidden_size, config.latent_width, bias=config.attention_bias)
        else:
            self.qkv_a_proj = Linear(
                config.hidden_size, config.q_lora_rank + config.latent_width, bias=config.attention_bias
            )
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(config.q_lora_rank, qk_rows, bias=False)
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            config.kv_lora_rank, heads * (config.qk_nope_head_dim + config.v_head_dim), bias=False
        )
        self.o_proj = Linear(heads * config.v_head_dim, config.hidden_size, bias=config.attention_bias)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``hidden`` ``[T, hidden_size]`` -> ``[T, hidden_size]``; writes the new tokens' latents
        into ``kv_cache`` at ``metadata.slot_mapping`` first, so they attend to themselves."""
        config = self.config
        tokens, heads, nope, rank = hidden.shape[0], config.num_heads, config.qk_nope_head_dim, config.kv_lora_rank
        q, latent = self._project(hidden)
        q = q.view(tokens, heads, config.qk_head_dim)
        # The query heads' rotary parts and the shared rotary key, rotated together.
        qk_rope = self._rotate(torch.cat((q[..., nope:], latent[:, None, rank:]), dim=1), cos, sin)
        entry = torch.cat((self.kv_a_layernorm(latent[:, :rank]), qk_rope[:, heads]), dim=-1)
        k_cache = kv_cache[0]
        k_cache.view(-1, config.latent_width).index_copy_(0, metadata.slot_mapping, entry)

        absorb = self.kv_b_proj.weight.view(heads, nope + config.v_head_dim, rank)
        q_latent = torch.bmm(q[..., :nope].transpose(0, 1), absorb[:, :nope]).transpose(0, 1)  # [T, H, r]
        out = self._attend(torch.cat((q_latent, qk_rope[:, :heads]), dim=-1), k_cache, metadata)  # [T, H, r]
        out = torch.bmm(out.transpose(0, 1), absorb[:, nope:].transpose(1, 2))  # [H, T, v]
        return self.o_proj(out.transpose(0, 1).reshape(tokens, heads * config.v_head_dim))

    def _project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries ``[T, H * qk_head_dim]`` and the raw latent ``[T, r + rope]`` (not yet normed)."""
        config = self.config
        if config.q_lora_rank is None:
            return self.q_proj(hidden), self.kv_a_proj_with_mqa(hidden)
        down = self.qkv_a_proj(hidden)
        q = self.q_b_proj(self.q_a_layernorm(down[:, : config.q_lora_rank]))
        return q, down[:, config.q_lora_rank :]

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE over ``x`` ``[T, heads, rope]``. Interleaved pairs are first gathered into halves
        (evens, then odds): the same rotation, laid out for :func:`apply_rotary`. Queries and keys
        are permuted alike, so their dot products are unchanged."""
        if self.config.rope_interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rotary(x, cos, sin)

    def _attend(self, q: torch.Tensor, k_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
        """Latent queries ``[T, H, r + rope]`` over each sequence's cached latents -> ``[T, H, r]``.

        One key head serves every query head (multi-query attention), so the heads fold into the
        query axis exactly as grouped-query attention folds a KV head's group.
        """
        config = self.config
        heads, width, rank = config.num_heads, config.latent_width, config.kv_lora_rank
        num_seqs, max_q, max_len = metadata.num_seqs, metadata.max_query_len, metadata.max_seq_len
        # [B, 1, L, r + rope]; the values are a view of the keys' first r columns.
        keys = k_cache.index_select(0, metadata.context_block_ids).view(num_seqs, -1, width)[:, :max_len]
        keys = keys.unsqueeze(1)
        values = keys[..., :rank]
        scale = config.softmax_scale
        if max_q == 1:
            out = F.scaled_dot_product_attention(
                q.view(num_seqs, 1, heads, width), keys, values, attn_mask=metadata.attn_mask, scale=scale
            )
            return out.view(num_seqs, heads, rank)
        pad_index = metadata.query_pad_index
        if pad_index is not None:
            q = q.new_zeros(num_seqs * max_q, heads, width).index_copy_(0, pad_index, q)
        # [B, Q, H, W] -> [B, 1, H * Q, W]: rows h * Q + j, the layout of grouped_mask(H).
        q = q.view(num_seqs, max_q, heads, width).transpose(1, 2).reshape(num_seqs, 1, heads * max_q, width)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=metadata.grouped_mask(heads), scale=scale)
        out = out.view(num_seqs, heads, max_q, rank).transpose(1, 2).reshape(num_seqs * max_q, heads, rank)
        if pad_index is not None:
            out = out.index_select(0, pad_index)
        return out
