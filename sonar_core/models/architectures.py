"""The built-in architectures: Llama (SmolLM2, Llama 3), Qwen2 and Qwen3 as configurations of
:class:`~sonar_core.models.transformer.DecoderOnlyLM`.
"""

from __future__ import annotations

from typing import Any

from sonar_core.layers.decoder import DecoderLayerConfig
from sonar_core.models.registry import register_architecture
from sonar_core.models.transformer import DecoderOnlyLM


def _common(hf_config: Any, **switches: Any) -> DecoderLayerConfig:
    head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads
    return DecoderLayerConfig(
        hidden_size=hf_config.hidden_size,
        intermediate_size=hf_config.intermediate_size,
        num_heads=hf_config.num_attention_heads,
        num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads,
        head_dim=head_dim,
        rms_norm_eps=hf_config.rms_norm_eps,
        hidden_act=hf_config.hidden_act,
        **switches,
    )


class LlamaForCausalLM(DecoderOnlyLM):
    """Llama 1-3 and derivatives (SmolLM2): ``attention_bias`` covers q/k/v/o, ``mlp_bias`` the MLP."""

    @classmethod
    def layer_config(cls, hf_config: Any) -> DecoderLayerConfig:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return _common(
            hf_config, qkv_bias=bias, o_bias=bias, mlp_bias=bool(getattr(hf_config, "mlp_bias", False))
        )


class Qwen2ForCausalLM(DecoderOnlyLM):
    """Qwen2 / Qwen2.5: biases on q/k/v only."""

    @classmethod
    def layer_config(cls, hf_config: Any) -> DecoderLayerConfig:
        return _common(hf_config, qkv_bias=True)


class Qwen3ForCausalLM(DecoderOnlyLM):
    """Qwen3 (dense): per-head RMSNorm of q and k before RoPE, ``head_dim`` from the config."""

    @classmethod
    def layer_config(cls, hf_config: Any) -> DecoderLayerConfig:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return _common(hf_config, qkv_bias=bias, o_bias=bias, qk_norm=True)


for _cls in (LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM):
    register_architecture(_cls.__name__, _cls)
