"""Target model implementations (Llama, Qwen2, Qwen3, DeepSeek-V3, Gemma 4, Qwen3-Next), their registry and
checkpoint loading.

The names below are imported on first access (PEP 562): the registry's architecture names are
needed by configuration checks that must not wait for torch, which the model code imports.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "CausalLM": "sonar_core.models.base",
    "LoadedModel": "sonar_core.models.loader",
    "load_model": "sonar_core.models.loader",
    "load_tokenizer": "sonar_core.models.loader",
    "UnsupportedArchitectureError": "sonar_core.models.registry",
    "get_model_class": "sonar_core.models.registry",
    "register_architecture": "sonar_core.models.registry",
    "supported_architectures": "sonar_core.models.registry",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
