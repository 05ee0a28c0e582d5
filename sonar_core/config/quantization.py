"""The quantized checkpoint formats Sonar reads, decided from config.json alone.

A checkpoint is either unquantized or block-scaled FP8, the layout of DeepSeek-V3 and the
``-FP8`` releases of Qwen3: ``quantization_config`` says ``quant_method: "fp8"``, ``fmt: "e4m3"``,
``activation_scheme: "dynamic"`` and ``weight_block_size: [rows, columns]``, and every quantized
linear weight ``X.weight`` (``float8_e4m3fn``, shape ``[out, in]``) comes with a float32
``X.weight_scale_inv`` of shape ``[ceil(out / rows), ceil(in / columns)]``. The checkpoint readers
(``sonar_core.models.weights``) dequantize those weights as they stream them; the configuration
check (``TargetInfo``) refuses every other quantization before a weight is read, so an unsupported
checkpoint never fails half-way through loading.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sonar_core.errors import ConfigError

# The tensor next to a quantized weight: ``X.weight`` -> ``X.weight_scale_inv``.
SCALE_SUFFIX = "_scale_inv"
SUPPORTED = (
    'Sonar reads unquantized checkpoints and block-scaled FP8 ones (quant_method "fp8" with fmt "e4m3", '
    'activation_scheme "dynamic" and weight_block_size [rows, columns], as DeepSeek-V3 and Qwen3-FP8 '
    "ship them); their weights are dequantized at load"
)
_FIX = (
    "use the model's unquantized release (bfloat16, float16 or float32), its block-scaled FP8 release, "
    "or a GGUF file"
)
# Scale storage formats (DeepSeek-V3.1 marks power-of-two scales "ue8m0"); both dequantize alike.
_SCALE_FORMATS = ("float", "ue8m0")


@dataclass(frozen=True)
class BlockFP8:
    """A block-scaled FP8 checkpoint: one float32 scale per ``block_size`` tile of each weight."""

    # (rows of the output dimension, columns of the input dimension). Weights without a scale (the
    # modules of ``modules_to_not_convert``, embeddings, norms) are stored unquantized.
    block_size: tuple[int, int]


def checkpoint_quantization(config: Mapping[str, Any], *, source: str = "") -> BlockFP8 | None:
    """The quantization of a checkpoint from its config.json dict (None when unquantized).

    Multimodal configs may keep it in ``text_config``. Raises :class:`ConfigError` on ``model``
    (callers checking a draft rename the field) whose message names the offending
    ``quantization_config`` key and what Sonar supports.
    """
    text = config.get("text_config")
    settings = config.get("quantization_config")
    if settings is None and isinstance(text, Mapping):
        settings = text.get("quantization_config")
    if settings is None:
        return None
    where = source or "the model's config.json"

    def refuse(key: str, problem: str) -> ConfigError:
        return ConfigError("model", f"{where}: quantization_config.{key} {problem}. {SUPPORTED}", _FIX)

    if not isinstance(settings, Mapping):
        raise ConfigError("model", f"{where}: quantization_config is not a JSON object. {SUPPORTED}", _FIX)
    method = settings.get("quant_method")
    if method != "fp8":
        raise refuse("quant_method", "is not set" if method is None else f"is {method!r}, a quantization Sonar cannot load")
    for key, default, allowed in (
        ("fmt", "e4m3", ("e4m3",)),
        ("activation_scheme", "dynamic", ("dynamic",)),
        ("scale_fmt", "float", _SCALE_FORMATS),
        ("expert_dtype", "fp8", ("fp8",)),
    ):
        value = settings.get(key)
        if value is not None and str(value).lower() not in allowed:
            hint = " (static activation scales)" if key == "activation_scheme" else ""
            raise refuse(key, f"is {value!r}{hint}; only {' or '.join(map(repr, allowed))} is supported "
                              f"({default!r} when unset)")
    block = settings.get("weight_block_size")
    if block is None:
        raise refuse("weight_block_size", "is not set: per-tensor FP8 scales are not supported, only block scales")
    if (
        not isinstance(block, list | tuple)
        or len(block) != 2
        or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in block)
    ):
        raise refuse("weight_block_size", f"is {block!r}; it must be two positive integers [rows, columns]")
    return BlockFP8(block_size=(block[0], block[1]))
