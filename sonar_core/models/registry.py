"""Which model class implements a checkpoint, keyed by ``architectures[0]`` of its config.json."""

from __future__ import annotations

import importlib
from typing import Any

from sonar_core.models.base import CausalLM

_REGISTRY: dict[str, type[CausalLM]] = {}
_BUILTINS_MODULE = "sonar_core.models.architectures"


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


def _ensure_builtins() -> None:
    # Imported on first use, not at module import, because the built-in module registers itself
    # through register_architecture above.
    importlib.import_module(_BUILTINS_MODULE)


def supported_architectures() -> list[str]:
    """Registered architecture names, sorted."""
    _ensure_builtins()
    return sorted(_REGISTRY)


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
    cls = _REGISTRY.get(architecture)
    if cls is None:
        raise UnsupportedArchitectureError(
            f"architecture {architecture!r} (model_type {model_type!r}) is not supported; "
            f"supported architectures: {', '.join(supported)}"
        )
    return cls
