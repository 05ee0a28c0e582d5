"""Which model class implements a checkpoint, keyed by ``architectures[0]`` of its config.json."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sonar_core.models.base import CausalLM

_REGISTRY: dict[str, type[CausalLM]] = {}
# The built-in architectures and the module that defines and registers each. The names are known
# without importing the model code (and torch): configuration checks and plugin registration list
# them before anything loads. A module is imported when its class is first asked for.
# tests/models/test_model_loader.py checks this table against the classes the modules register.
BUILTIN_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "sonar_core.models.architectures",
    "Qwen2ForCausalLM": "sonar_core.models.architectures",
    "MiMoForCausalLM": "sonar_core.models.architectures",
    "Qwen3ForCausalLM": "sonar_core.models.architectures",
    "DeepseekV3ForCausalLM": "sonar_core.models.deepseek_v3",
    "Qwen3NextForCausalLM": "sonar_core.models.qwen3_next",
    "Gemma4ForCausalLM": "sonar_core.models.gemma4",
    "Gemma4ForConditionalGeneration": "sonar_core.models.gemma4",
}


class UnsupportedArchitectureError(ValueError):
    """The checkpoint's architecture has no registered implementation."""


def register_architecture(name: str, cls: type[CausalLM]) -> None:
    """Make ``cls`` the implementation of architecture ``name``.

    Registering a different class under a taken name is an error that names both classes: two
    plugins silently replacing each other's model would be hard to diagnose.
    """
    current = _REGISTRY.get(name)
    if current is not None and current is not cls:
        raise ValueError(
            f"architecture {name!r} is already registered to {current.__module__}.{current.__qualname__}; "
            f"refusing to replace it with {cls.__module__}.{cls.__qualname__}"
        )
    _REGISTRY[name] = cls


# Built-in architectures with recurrent (linear-attention) layers: their state lives in a
# per-request cache beside the paged KV cache (sonar_core.kv.state), which the engine keeps for
# the target only, so they cannot serve as a generic draft model.
RECURRENT_ARCHITECTURES: frozenset[str] = frozenset({"Qwen3NextForCausalLM"})


def supported_architectures() -> list[str]:
    """The built-in and registered architecture names, sorted (no model code is imported)."""
    return sorted({*BUILTIN_ARCHITECTURES, *_REGISTRY})


def architecture_of(hf_config: Any) -> tuple[str, str]:
    """``(architectures[0], model_type)`` of a config object or a raw config.json dict."""
    get = hf_config.get if isinstance(hf_config, dict) else lambda key: getattr(hf_config, key, None)
    architectures = get("architectures") or []
    return (architectures[0] if architectures else "<none>"), (get("model_type") or "<none>")


def get_model_class(hf_config: Any) -> type[CausalLM]:
    """The class for a config (a ``PretrainedConfig`` or the raw config.json dict).

    Raises :class:`UnsupportedArchitectureError` naming the architecture, the ``model_type`` and
    the supported architectures.
    """
    architecture, model_type = architecture_of(hf_config)
    supported = supported_architectures()
    if architecture not in _REGISTRY and architecture in BUILTIN_ARCHITECTURES:
        importlib.import_module(BUILTIN_ARCHITECTURES[architecture])  # it registers its classes
    cls = _REGISTRY.get(architecture)
    if cls is None:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} (model_type {model_type!r}) is not supported; "
            f"supported architectures: {', '.join(supported)}"
        )
    return cls
