"""The built-in architectures: Llama (SmolLM2, Llama 3), Qwen2 (and MiMo) and Qwen3 as configurations of
:class:`~sonar_core.models.transformer.DecoderOnlyLM`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from sonar_core.layers.decoder import DecoderLayerConfig
from sonar_core.models import hf_config_cache
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

    honours_sliding_window = True

    @classmethod
    def layer_config(cls, hf_config: Any) -> DecoderLayerConfig:
        return _common(hf_config, qkv_bias=True)


class MiMoForCausalLM(Qwen2ForCausalLM):
    """Xiaomi MiMo-7B: a Qwen2 model whose checkpoint adds MTP layers (``model.mtp_layers.*``, the
    MTP proposer's) and names remote code for model_type ``mimo``, which transformers does not
    know: the config is read as Qwen2's, keeping MiMo's own keys (``num_nextn_predict_layers``)."""

    @classmethod
    def read_hf_config(cls, model_dir: Path) -> Any:
        config = json.loads((Path(model_dir) / "config.json").read_text())
        return hf_config_from_dict({**config, "model_type": "qwen2"})


class Qwen3ForCausalLM(DecoderOnlyLM):
    """Qwen3 (dense): per-head RMSNorm of q and k before RoPE, ``head_dim`` from the config."""

    honours_sliding_window = True

    @classmethod
    def layer_config(cls, hf_config: Any) -> DecoderLayerConfig:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return _common(hf_config, qkv_bias=bias, o_bias=bias, qk_norm=True)


for _cls in (LlamaForCausalLM, Qwen2ForCausalLM, MiMoForCausalLM, Qwen3ForCausalLM):
    register_architecture(_cls.__name__, _cls)

# Families by model_type, for configs that describe layers rather than a whole checkpoint (the
# layer config of a draft head: EAGLE's LlamaConfig, speculators' transformer_layer_config).
LAYER_FAMILIES: dict[str, type[DecoderOnlyLM]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
}


def hf_config_from_dict(config: dict[str, Any]) -> Any:
    """A transformers config object of ``config``'s ``model_type`` (defaults filled the way the
    family's own checkpoints get them); extra keys stay attributes. ValueError when transformers
    refuses the values. Kept in the config cache, so a later start reads it without transformers."""
    model_type = config.get("model_type", "llama")
    values = {
        key: value for key, value in config.items() if key not in ("model_type", "transformers_version")
    }

    def build() -> Any:
        from transformers import AutoConfig

        try:
            return AutoConfig.for_model(model_type, **values)
        except Exception as exc:  # transformers' validators raise their own error types
            raise ValueError(f"transformers refuses the config: {exc}") from exc

    return hf_config_cache.config_of_values({"model_type": model_type, **values}, build)


def layer_config_for(hf_config: Any) -> DecoderLayerConfig:
    """The decoder-layer shape a config of a supported family describes (by its model_type).

    Raises ValueError naming the model_type and the supported ones.
    """
    family = LAYER_FAMILIES.get(getattr(hf_config, "model_type", ""))
    if family is None:
        raise ValueError(
            f"layers of model_type {getattr(hf_config, 'model_type', None)!r} are not supported "
            f"(supported: {', '.join(LAYER_FAMILIES)})"
        )
    return family.layer_config(hf_config)


# Architectures with layers of their own register themselves when imported.
from sonar_core.models import deepseek_v3, gemma4, qwen3_next  # noqa: E402, F401
