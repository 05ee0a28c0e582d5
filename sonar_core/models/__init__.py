"""Target model implementations (Llama, Qwen2, Qwen3), their registry and checkpoint loading."""

from sonar_core.models.base import CausalLM
from sonar_core.models.loader import (
    DEFAULT_MODEL_NAME,
    LoadedModel,
    load_model,
    load_tokenizer,
    resolve_model_path,
)
from sonar_core.models.registry import (
    UnsupportedArchitectureError,
    get_model_class,
    register_architecture,
    supported_architectures,
)

__all__ = [
    "DEFAULT_MODEL_NAME",
    "CausalLM",
    "LoadedModel",
    "UnsupportedArchitectureError",
    "get_model_class",
    "load_model",
    "load_tokenizer",
    "register_architecture",
    "resolve_model_path",
    "supported_architectures",
]
