"""The engine configuration: the flags of ``aphrodite serve`` and the keywords of ``LLM(...)``.

Each field is the snake_case form of a command-line flag (``max_num_seqs`` is
``--max-num-seqs``). Rules that need only these values are checked on construction; the rules that
need the model's own limits are checked by ``validate_engine_config``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator, model_validator

from sonar_core.config.json_value import parse_json_object
from sonar_core.config.speculative import SpeculativeConfig
from sonar_core.config.validation_errors import config_error_from_validation
from sonar_core.cpu_features import fast_bf16
from sonar_core.errors import ConfigError

if TYPE_CHECKING:
    import torch

# The dtype names users pass (vLLM's and PyTorch's spellings) and the one each means.
DTYPE_ALIASES: Mapping[str, str] = {
    "auto": "auto",
    "float32": "float32",
    "fp32": "float32",
    "float": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
}
DEVICES = ("auto", "cpu", "cuda")
# Per-step token budget when max_num_batched_tokens is unset: this many, or max_model_len when that
# is larger, so that a full-length prompt always fits one step.
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048


class EngineConfig(BaseModel):
    """Everything the engine needs to load a model and schedule requests."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, validate_default=True)

    model: str | None = None
    """Target checkpoint: a local folder with config.json, a .gguf file or a Hugging Face
    repository id (taken from the local Hugging Face cache, else downloaded into it). Unset: the
    embedded default model (SmolLM2-135M-Instruct)."""

    revision: str | None = None
    """Branch, tag or commit of ``model`` when it is a repository id. Unset: the default branch."""

    tokenizer: str | None = None
    """Tokenizer to load instead of the model's own (same forms as ``model``)."""

    tokenizer_revision: str | None = None
    """Branch, tag or commit of ``tokenizer`` when it is a repository id. Unset: the default branch."""

    dtype: str = "auto"
    """Weights and activations: float32 (fp32, float), float16 (fp16, half), bfloat16 (bf16) or
    auto (bfloat16 on CUDA and on CPUs with AVX-512 BF16, AMX or AVX2 + FMA, float32 on others)."""

    device: str = "auto"
    """cpu, cuda (or cuda:N), or auto (CUDA when a device is available, else CPU)."""

    seed: int = 0
    """Seed of the engine's random generator (requests may bring their own)."""

    max_model_len: int | None = None
    """Longest request (prompt plus output) in tokens. Unset: the model's limit
    (max_position_embeddings); a larger value is an error."""

    max_num_seqs: int = 256
    """Most requests scheduled in one step. Lower it first when memory runs out."""

    max_num_batched_tokens: int | None = None
    """Token budget of one step (prompt tokens, decode tokens and drafts together). Unset: 2048
    or max_model_len, whichever is larger."""

    block_size: int = 16
    """Tokens per block of the paged KV cache."""

    enable_prefix_caching: bool | None = None
    """Reuse the KV cache of full blocks that earlier requests computed for the same leading
    tokens, so that a shared prompt prefix is prefilled once. Unset: on wherever it is lossless
    (every built-in speculative method but the hidden-state exporter), off with a speculative
    method whose own KV or target states per position a cached block cannot hold (the exporter, a
    custom proposer that declares no prefix_cache_lookahead) and with linear-attention models;
    true with one of those is an error."""

    gpu_memory_utilization: float = 0.9
    """Fraction of the GPU's memory the engine may use (0 < x <= 1); what the weights leave of it
    goes to the KV cache. Ignored on CPU."""

    kv_cache_memory_gb: float | None = None
    """KV cache size in GiB. Unset: 2 GiB on CPU; on CUDA, what gpu_memory_utilization leaves."""

    tensor_parallel_size: int = 1
    """Ranks the target is split over (one process each: CUDA devices, or shares of the CPU's
    cores). Attention heads, KV heads and MLP columns split evenly, so the size must divide them."""

    pipeline_parallel_size: int = 1
    """Pipeline stages the target's layers are split over. Sonar has no pipeline parallelism: only
    1 is accepted (the flag parses so that vLLM command lines give a clear error)."""

    data_parallel_size: int = 1
    """Engine replicas behind one ``aphrodite serve``: each is a whole engine in a process of its
    own, with its own weights and KV cache, and each request goes to the replica with the fewest
    requests in flight. On the CPU the replicas share the cores (each runs cores / N threads); on
    CUDA each has devices of its own (tensor_parallel_size each). The Python ``LLM`` runs one
    engine and accepts only 1."""

    trust_remote_code: bool = False
    """Let a tokenizer run the Python code its repository ships (a custom tokenizer class named in
    tokenizer_config.json's auto_map); the repository's .py files are then downloaded too.
    Model code never comes from a checkpoint: Sonar runs its own implementation of each
    architecture, with or without the flag."""

    enforce_eager: bool = False
    """Run PyTorch eagerly: no CUDA graphs or compilation."""

    disable_log_stats: bool = False
    """Do not log the periodic engine and ``SpecDecoding metrics`` statistics."""

    speculative_config: SpeculativeConfig | None = None
    """Speculative decoding (a dict, or its JSON text). Unset: no speculation."""

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_name(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        name = DTYPE_ALIASES.get(value.strip().lower().removeprefix("torch."))
        if name is None:
            raise ConfigError(
                "dtype",
                f"unknown dtype {value!r}",
                "use one of auto, float32, float16, bfloat16 (also accepted: fp32, float, fp16, half, bf16)",
            )
        return name

    @field_validator("device", mode="before")
    @classmethod
    def _device_name(cls, value: object) -> object:
        if not isinstance(value, str):
            return value
        name = value.strip().lower()
        kind, _, index = name.partition(":")
        if kind not in DEVICES or (index and (kind != "cuda" or not index.isdigit())):
            raise ConfigError("device", f"unknown device {value!r}", "use cpu, cuda, cuda:N or auto")
        return name

    @field_validator("tensor_parallel_size")
    @classmethod
    def _positive_ranks(cls, value: int) -> int:
        if value < 1:
            raise ConfigError(
                "tensor_parallel_size",
                f"tensor_parallel_size must be at least 1, got {value}",
                "set --tensor-parallel-size (tensor_parallel_size in Python) to the number of devices to split "
                "the model over, or remove it (1: one device)",
            )
        return value

    @field_validator("pipeline_parallel_size")
    @classmethod
    def _no_pipeline(cls, value: int) -> int:
        # No pipeline implementation exists; the fix names the alternatives (DSpark's documented
        # advice for scaling a deployment).
        if value != 1:
            raise ConfigError(
                "pipeline_parallel_size",
                f"pipeline parallelism is not supported; pipeline_parallel_size={value}",
                "remove --pipeline-parallel-size (pipeline_parallel_size in Python) or set it to 1; "
                "use tensor parallelism or data parallelism to spread a deployment over devices",
            )
        return value

    @field_validator("gpu_memory_utilization")
    @classmethod
    def _fraction(cls, value: float) -> float:
        if not 0.0 < value <= 1.0:
            raise ConfigError(
                "gpu_memory_utilization",
                f"must be a fraction of the GPU's memory greater than 0 and at most 1, got {value}",
                "set --gpu-memory-utilization to a value such as 0.9 (0.85 leaves more room for other processes)",
            )
        return value

    @field_validator("max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size", "data_parallel_size")
    @classmethod
    def _positive_count(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value is not None and value < 1:
            flag = "--" + info.field_name.replace("_", "-")
            raise ConfigError(
                info.field_name,
                f"must be a positive number, got {value}",
                f"set {flag} to 1 or more, or leave it unset for the default",
            )
        return value

    @field_validator("kv_cache_memory_gb")
    @classmethod
    def _positive_memory(cls, value: float | None) -> float | None:
        if value is not None and value <= 0:
            raise ConfigError(
                "kv_cache_memory_gb",
                f"the KV cache needs a positive size in GiB, got {value}",
                "set --kv-cache-memory-gb to a positive number such as 2, or leave it unset",
            )
        return value

    @field_validator("speculative_config", mode="before")
    @classmethod
    def _speculative_from_json(cls, value: object) -> object:
        if isinstance(value, str):
            return parse_json_object(value, "speculative_config")
        return value

    @model_validator(mode="after")
    def _cross_field_rules(self) -> EngineConfig:
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError(
                "max_num_batched_tokens",
                f"a step of {self.max_num_batched_tokens} tokens cannot give each of max_num_seqs="
                f"{self.max_num_seqs} requests one token",
                f"raise --max-num-batched-tokens to at least {self.max_num_seqs}, or lower --max-num-seqs",
            )
        if self.device.startswith("cuda"):
            _require_cuda(self.device)
        if self.data_parallel_size > 1 and self.resolved_device().startswith("cuda"):
            _require_devices_for_replicas(self.device, self.data_parallel_size, self.tensor_parallel_size)
        return self

    @classmethod
    def build(cls, **kwargs: Any) -> EngineConfig:
        """Like ``EngineConfig(**kwargs)``, but every problem is one :class:`ConfigError`."""
        try:
            return cls(**kwargs)
        except ValidationError as exc:
            raise config_error_from_validation(exc, known_fields=cls.model_fields) from None

    def resolved_device(self) -> str:
        """The device name: ``auto`` becomes cuda when a CUDA device is available, else cpu."""
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def resolved_dtype(self) -> str:
        """The dtype name: ``auto`` becomes bfloat16 on CUDA and on a CPU where it decodes faster
        than float32 (AVX-512 BF16 or AMX natively, AVX2 + FMA widening it in registers:
        docs/performance.md), float32 on other CPUs."""
        if self.dtype != "auto":
            return self.dtype
        if self.resolved_device().startswith("cuda"):
            return "bfloat16"
        return "bfloat16" if fast_bf16() else "float32"

    def torch_device(self) -> torch.device:
        import torch

        return torch.device(self.resolved_device())

    def torch_dtype(self) -> torch.dtype:
        import torch

        return getattr(torch, self.resolved_dtype())

    def token_budget(self, max_model_len: int) -> int:
        """Tokens one step may schedule, for a request limit of ``max_model_len``."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return max(DEFAULT_MAX_NUM_BATCHED_TOKENS, max_model_len)


def _require_cuda(device: str) -> None:
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            "device",
            f"device {device!r} was requested, but no CUDA device is available to this PyTorch "
            f"({torch.__version__})",
            "use --device cpu (device='cpu' in Python), or leave the device unset to use a GPU when there is one",
        )
    index = int(device.partition(":")[2] or 0)
    if index >= torch.cuda.device_count():
        raise ConfigError(
            "device",
            f"device {device!r} was requested, but only {torch.cuda.device_count()} CUDA device(s) exist",
            f"use a device index below {torch.cuda.device_count()}",
        )


def _require_devices_for_replicas(device: str, replicas: int, ranks: int) -> None:
    """Each replica of a data-parallel server has devices of its own (one per tensor-parallel
    rank), so there must be enough of them and no device may be named (every replica would share
    it)."""
    import torch

    if ":" in device:
        raise ConfigError(
            "data_parallel_size",
            f"{replicas} replicas cannot share the one device {device!r}: each replica runs on devices of its own",
            "use --device cuda (or leave it unset) with --data-parallel-size, and CUDA_VISIBLE_DEVICES to "
            "choose the devices",
        )
    count = torch.cuda.device_count()
    if replicas * ranks > count:
        each = "a CUDA device each" if ranks == 1 else f"{ranks} CUDA devices each (tensor_parallel_size={ranks})"
        raise ConfigError(
            "data_parallel_size",
            f"{replicas} replicas need {each}, {replicas * ranks} in all, but only {count} exist",
            f"lower --data-parallel-size to at most {max(count // ranks, 1)}, or serve on the CPU with --device cpu",
        )
