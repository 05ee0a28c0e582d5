"""Target model implementations (Llama, Qwen2, Qwen3, DeepSeek-V3, Gemma 4), their registry and checkpoint
loading."""

from sonar_core.models.base import CausalLM
from sonar_core.models.loader import (
    LoadedModel,
    load_model,
    load_tokenizer,
)
from sonar_core.models.registry import (
    UnsupportedArchitectureError,
    get_model_class,
    register_architecture,
    supported_architectures,
)

__all__ = [
    "CausalLM",
    "LoadedModel",
    "UnsupportedArchitectureError",
    "get_model_class",
    "load_model",
    "load_tokenizer",
    "register_architecture",
    "supported_architectures",
]
