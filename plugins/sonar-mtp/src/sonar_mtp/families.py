"""The MTP layouts Sonar runs, by target architecture (FORMATS.md section 5).

An :class:`MtpFamily` says where a target checkpoint keeps its MTP layers, how their tensors are
named, in which order a layer concatenates the token embedding and the previous hidden state, and
which state it feeds to the next chained step. Every family's layer is the same computation::

    u   = proj(concat[embed_norm(e), hidden_norm(h)])      (or hidden first)
    y   = block(u)                                          a decoder layer of the target's family
    out = output_norm(y)                                    the target's LM head scores out
    next step reads out (normed families) or y

with ``e`` the target's embedding of the token after the position and ``h`` the target's final
(post-norm) hidden state at the position, then the layer's own carry at later steps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

# This module is imported when the plugin registers (and with every configuration check): it
# describes the layouts without importing torch; the builders import the layers they build.
if TYPE_CHECKING:
    import torch
    from torch import nn

    from sonar_core.kv import KVLayerSpec
    from sonar_core.layers.decoder import DecoderLayerConfig
    from sonar_core.models.weights import FusedMap

# The Gemma 4 assistant checkpoint's architecture (sonar_mtp.assistant runs it).
ASSISTANT_ARCHITECTURE = "Gemma4AssistantForCausalLM"


class Rotary(Protocol):
    """A family's rotary table (Sonar's RoPE, or MLA's for DeepSeek)."""

    def cos_sin(
        self, positions: torch.Tensor, dtype: torch.dtype, upto: int | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]: ...


@dataclass(frozen=True)
class MtpFamily:
    """Where and how one target family stores its MTP layers."""

    architecture: str  # the target's architectures[0]
    layout: str  # for tables and messages
    notes: str
    # Checkpoint name of MTP layer i's tensors, before the layer's own names.
    layer_prefix: Callable[[dict[str, Any], int], str]
    # The name prefixes of every tensor that belongs to the MTP layers (claimed from the target's
    # loader whether or not MTP runs).
    claims: Callable[[dict[str, Any]], list[str]]
    # The layer's own checkpoint names -> Sonar's module names (embed_norm, hidden_norm, proj,
    # output_norm; everything else belongs to the decoder block).
    renames: dict[str, str]
    # Own names the checkpoint carries that Sonar does not load (copies of the target's modules).
    unused: frozenset[str]
    hidden_first: bool  # concat order: [hidden, embedding] (MiMo) or [embedding, hidden]
    carry_normed: bool  # the next step reads output_norm(y) (MiMo) or y (DeepSeek)
    # The decoder block of MTP layer i, from the target's transformers config; it is called as
    # ``block(hidden, cos, sin, kv_cache, metadata)`` with the tables of ``build_rotary``.
    build_block: Callable[[Any, int], nn.Module]
    build_rotary: Callable[[Any], Rotary]
    kv_spec: Callable[[Any], KVLayerSpec]
    fused: Callable[[Any], FusedMap]
    # The layer's embed_norm, hidden_norm and output_norm, from (hidden_size, rms_norm_eps).
    build_norm: Callable[[int, float], nn.Module] = lambda hidden, eps: _rms_norm(hidden, eps)
    # The most MTP layers the layout can hold (Qwen3-Next's fc and norms are shared by its layers,
    # which Sonar runs for one layer only); None: any number.
    max_layers: int | None = None

    def layer_count(self, config: dict[str, Any]) -> int:
        """MTP layers the config declares (``num_nextn_predict_layers``; 0 when it declares none)."""
        return int(config.get("num_nextn_predict_layers") or 0)

    def prefixes(self, config: dict[str, Any]) -> list[str]:
        """The tensor-name prefix of each declared MTP layer, in order."""
        return [self.layer_prefix(config, index) for index in range(self.layer_count(config))]

    def module_name(self, name: str, prefixes: list[str]) -> str | None:
        """Sonar's module name (``layers.{i}.…``) of a checkpoint tensor; None when the name is
        not an MTP layer's (or is one Sonar does not load)."""
        for index, prefix in enumerate(prefixes):
            if name.startswith(prefix):
                own = name[len(prefix) :]
                if any(own == unused or own.startswith(unused + ".") for unused in self.unused):
                    return None
                for source, target in self.renames.items():
                    if own.startswith(source + "."):
                        return f"layers.{index}.{target}.{own[len(source) + 1 :]}"
                return f"layers.{index}.block.{own}"
        return None


def _rms_norm(hidden: int, eps: float) -> nn.Module:
    from sonar_core.layers import RMSNorm

    return RMSNorm(hidden, eps)


def _qwen2_layer(hf_config: Any) -> DecoderLayerConfig:
    from sonar_core.models.architectures import Qwen2ForCausalLM

    return Qwen2ForCausalLM.layer_config(hf_config)


def _qwen2_rotary(hf_config: Any) -> Rotary:
    from sonar_core.layers import RopeConfig, RotaryEmbedding

    return RotaryEmbedding(RopeConfig.from_hf_config(hf_config, _qwen2_layer(hf_config).head_dim))


def _qwen2_kv(hf_config: Any) -> KVLayerSpec:
    from sonar_core.kv import KVLayerSpec

    layer = _qwen2_layer(hf_config)
    return KVLayerSpec(num_kv_heads=layer.num_kv_heads, head_dim=layer.head_dim)


def _qwen2_block(hf_config: Any, index: int) -> nn.Module:
    from sonar_core.layers import DecoderLayer

    return DecoderLayer(_qwen2_layer(hf_config))


def _qwen2_fused(hf_config: Any) -> FusedMap:
    from sonar_core.layers.decoder import fused_projections

    return fused_projections(_qwen2_layer(hf_config))


MIMO = MtpFamily(
    architecture="MiMoForCausalLM",
    layout="MiMo MTP (model.mtp_layers.*)",
    notes="Qwen2 layer per MTP layer, [hidden, embedding] order; the target's embedding and LM head",
    layer_prefix=lambda config, index: f"model.mtp_layers.{index}.",
    claims=lambda config: ["model.mtp_layers."],
    renames={
        "token_layernorm": "embed_norm",
        "hidden_layernorm": "hidden_norm",
        "input_proj": "proj",
        "final_layernorm": "output_norm",
    },
    unused=frozenset(),
    hidden_first=True,
    carry_normed=True,
    build_block=_qwen2_block,
    build_rotary=_qwen2_rotary,
    kv_spec=_qwen2_kv,
    fused=_qwen2_fused,
)

def _deepseek(hf_config: Any):
    from sonar_core.models.deepseek_v3 import DeepseekV3LayerConfig

    return DeepseekV3LayerConfig.from_hf_config(hf_config)


def _deepseek_block(hf_config: Any, index: int) -> nn.Module:
    from sonar_core.models.deepseek_v3 import DeepseekV3DecoderLayer

    # The MTP layer sits after the last decoder layer, so it has the MoE MLP of the deep layers.
    return DeepseekV3DecoderLayer(_deepseek(hf_config), hf_config.num_hidden_layers + index)


def _deepseek_rotary(hf_config: Any) -> Rotary:
    from sonar_core.layers.mla import MLARotary

    return MLARotary(_deepseek(hf_config).attention)


def _deepseek_prefixes(config: dict[str, Any]) -> list[str]:
    layers = int(config["num_hidden_layers"])
    return [f"model.layers.{layers + index}." for index in range(int(config.get("num_nextn_predict_layers") or 0))]


DEEPSEEK_V3 = MtpFamily(
    architecture="DeepseekV3ForCausalLM",
    layout="DeepSeek-V3 MTP (model.layers.{num_hidden_layers}.*)",
    notes="MLA + MoE layer, [embedding, hidden] order; embed_tokens and shared_head.head copies unused "
    "(the target's embedding and LM head serve)",
    layer_prefix=lambda config, index: f"model.layers.{int(config['num_hidden_layers']) + index}.",
    claims=_deepseek_prefixes,
    renames={"enorm": "embed_norm", "hnorm": "hidden_norm", "eh_proj": "proj", "shared_head.norm": "output_norm"},
    unused=frozenset({"embed_tokens", "shared_head.head"}),
    hidden_first=False,
    carry_normed=False,
    build_block=_deepseek_block,
    build_rotary=_deepseek_rotary,
    kv_spec=lambda hf_config: _deepseek(hf_config).attention.kv_spec(),
    fused=lambda hf_config: _deepseek(hf_config).fused_projections(),
)

def _qwen3_next(hf_config: Any):
    from sonar_core.models.qwen3_next import Qwen3NextLayerConfig

    return Qwen3NextLayerConfig.from_hf_config(hf_config)


def _qwen3_next_block(hf_config: Any, index: int) -> nn.Module:
    from sonar_core.models.qwen3_next import Qwen3NextAttentionLayer

    config = _qwen3_next(hf_config)
    return Qwen3NextAttentionLayer(config, moe=config.moe is not None)


def _qwen3_next_rotary(hf_config: Any) -> Rotary:
    from sonar_core.layers.rotary import RotaryEmbedding

    return RotaryEmbedding(_qwen3_next(hf_config).rope)


def _zero_centred_norm(hidden: int, eps: float) -> nn.Module:
    from sonar_core.layers.norms import ZeroCentredRMSNorm

    return ZeroCentredRMSNorm(hidden, eps)


QWEN3_NEXT = MtpFamily(
    architecture="Qwen3NextForCausalLM",
    layout="Qwen3-Next MTP (mtp.*)",
    notes="gated full-attention + sparse MoE layer, [embedding, hidden] order, zero-centred norms; the "
    "target's embedding and LM head",
    layer_prefix=lambda config, index: "mtp.",
    claims=lambda config: ["mtp."],
    renames={
        "pre_fc_norm_embedding": "embed_norm",
        "pre_fc_norm_hidden": "hidden_norm",
        "fc": "proj",
        "norm": "output_norm",
        "layers.0": "block",
    },
    unused=frozenset(),
    hidden_first=False,
    carry_normed=True,
    build_block=_qwen3_next_block,
    build_rotary=_qwen3_next_rotary,
    kv_spec=lambda hf_config: _qwen3_next(hf_config).kv_spec(),
    fused=lambda hf_config: _qwen3_next(hf_config).fused_projections(),
    build_norm=_zero_centred_norm,
    max_layers=1,
)

FAMILIES: dict[str, MtpFamily] = {family.architecture: family for family in (MIMO, DEEPSEEK_V3, QWEN3_NEXT)}


def family_of(architecture: str) -> MtpFamily | None:
    return FAMILIES.get(architecture)
