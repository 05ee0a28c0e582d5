"""DeepSeek-V3 (``DeepseekV3ForCausalLM``, model_type ``deepseek_v3``): multi-head latent attention
in every layer, a dense MLP in the first ``first_k_dense_replace`` layers and a mixture of experts
after them.

The decoder layer is a building block of its own: ``DeepseekV3DecoderLayer(config, layer_index)``
with ``config = DeepseekV3LayerConfig.from_hf_config(hf_config)`` builds any layer, including the
multi-token-prediction layer at index ``num_hidden_layers`` that the checkpoint stores under
``model.layers.{num_hidden_layers}.*``; ``layer.kv_spec()`` is its cache, ``MLARotary(config.attention)``
its cos/sin tables, and ``config.fused_projections()`` the name map for ``load_named_weights``
(matched on the names' tails, so it serves under any prefix).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from sonar_core.kv import KVCache, KVLayerSpec
from sonar_core.layers.attention import AttentionMetadata
from sonar_core.layers.linear import Linear, drop_prepacked, prepack_linears
from sonar_core.layers.mla import MLAConfig, MLARotary, MultiHeadLatentAttention, mla_fused_projections
from sonar_core.layers.moe import MoE, MoEConfig, gated_mlp, mlp_fused_projections, moe_fused_projections
from sonar_core.layers.norms import RMSNorm
from sonar_core.models.base import LayerStackLM
from sonar_core.models.registry import register_architecture
from sonar_core.models.weights import load_named_weights


@dataclass(frozen=True)
class DeepseekV3LayerConfig:
    """What every DeepSeek-V3 decoder layer is made of; the layer index picks dense MLP or MoE."""

    hidden_size: int
    intermediate_size: int  # the dense layers' MLP
    first_k_dense_replace: int
    rms_norm_eps: float
    hidden_act: str
    attention: MLAConfig
    moe: MoEConfig

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> DeepseekV3LayerConfig:
        return cls(
            hidden_size=int(hf_config.hidden_size),
            intermediate_size=int(hf_config.intermediate_size),
            first_k_dense_replace=int(getattr(hf_config, "first_k_dense_replace", None) or 0),
            rms_norm_eps=float(hf_config.rms_norm_eps),
            hidden_act=hf_config.hidden_act,
            attention=MLAConfig.from_hf_config(hf_config),
            moe=MoEConfig.from_hf_config(hf_config),
        )

    def uses_moe(self, layer_index: int) -> bool:
        return layer_index >= self.first_k_dense_replace

    def fused_projections(self) -> dict[str, tuple[str, int, int]]:
        """Checkpoint module -> (fused module, rows) for dense and MoE layers alike."""
        return {
            **mla_fused_projections(self.attention),
            **mlp_fused_projections("mlp.", self.intermediate_size),
            **moe_fused_projections(self.moe),
        }


class DeepseekV3DecoderLayer(nn.Module):
    """``h + attn(norm(h))`` then ``h + mlp(norm(h))``, with MLA attention and, from
    ``first_k_dense_replace`` on, a mixture of experts as the MLP."""

    def __init__(self, config: DeepseekV3LayerConfig, layer_index: int) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MultiHeadLatentAttention(config.attention)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = (
            MoE(config.moe)
            if config.uses_moe(layer_index)
            else gated_mlp(config.hidden_size, config.intermediate_size, config.hidden_act)
        )

    @classmethod
    def from_hf_config(cls, hf_config: Any, layer_index: int) -> DeepseekV3DecoderLayer:
        return cls(DeepseekV3LayerConfig.from_hf_config(hf_config), layer_index)

    def kv_spec(self) -> KVLayerSpec:
        """The layer's cache: the compressed latent, one row per token."""
        return self.self_attn.config.kv_spec()

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``hidden`` ``[T, hidden_size]`` -> the layer's output ``[T, hidden_size]``; ``cos``/``sin``
        from :class:`MLARotary`."""
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, metadata)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DeepseekV3Stack(nn.Module):
    """Embedding, decoder layers and final norm (the ``model.`` prefix of the checkpoint)."""

    def __init__(self, vocab_size: int, num_layers: int, config: DeepseekV3LayerConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DeepseekV3DecoderLayer(config, index) for index in range(num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV3ForCausalLM(LayerStackLM):
    """DeepSeek-V3 over the paged cache. The checkpoint's multi-token-prediction layers
    (``model.layers.{num_hidden_layers + k}.*``, ``k < num_nextn_predict_layers``) are not part of
    this model: a proposer claims them, and unclaimed they are skipped, as transformers skips them."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.hf_config = hf_config
        self.config = DeepseekV3LayerConfig.from_hf_config(hf_config)
        self.num_layers = int(hf_config.num_hidden_layers)
        self.num_mtp_layers = int(getattr(hf_config, "num_nextn_predict_layers", None) or 0)
        self.tie_word_embeddings = bool(getattr(hf_config, "tie_word_embeddings", False))
        self.model = DeepseekV3Stack(hf_config.vocab_size, self.num_layers, self.config)
        self.lm_head = Linear(self.config.hidden_size, hf_config.vocab_size, bias=False)
        self.rotary = MLARotary(self.config.attention)
        self.tie_weights()

    def kv_cache_specs(self) -> list[KVLayerSpec]:
        return [layer.kv_spec() for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        mtp_prefixes = tuple(f"model.layers.{self.num_layers + k}." for k in range(self.num_mtp_layers))

        def ignore(name: str) -> bool:
            return (
                name.startswith(mtp_prefixes)
                or name.endswith("rotary_emb.inv_freq")
                or (self.tie_word_embeddings and name == "lm_head.weight")
            )

        drop_prepacked(self)
        load_named_weights(self, weights, self.config.fused_projections(), ignore)
        prepack_linears(self)


register_architecture(DeepseekV3ForCausalLM.__name__, DeepseekV3ForCausalLM)
