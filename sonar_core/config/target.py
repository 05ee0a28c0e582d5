"""What validation needs to know about a checkpoint, read from its config alone (no weights).

A checkpoint is a folder with config.json, a .gguf file (its metadata only) or a Hugging Face
repository id (its config files are fetched, never its weights); the embedded default model and
repository ids are found through :func:`~sonar_core.model_files.resolve_model_path`, so validation
and loading agree on what a name means.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from sonar_core.config.quantization import checkpoint_quantization
from sonar_core.errors import ConfigError
from sonar_core.hub import CONFIG, HubError
from sonar_core.model_files import cache_root, cached_json, file_cache_key, resolve_model_path

# Keys under which configs state the longest sequence; when several exist the smallest wins.
_LENGTH_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE scaling types whose factor does not extend the stated length (the config already gives the
# extended one).
_ROPE_TYPES_WITHOUT_EXTENSION = frozenset({"default", "su", "longrope", "llama3"})
# GGUF architecture name -> (Hugging Face model_type, architecture class).
_GGUF_ARCHITECTURES: Mapping[str, tuple[str, str]] = {
    "llama": ("llama", "LlamaForCausalLM"),
    "mistral": ("mistral", "MistralForCausalLM"),
    "qwen2": ("qwen2", "Qwen2ForCausalLM"),
    "qwen3": ("qwen3", "Qwen3ForCausalLM"),
    "qwen3moe": ("qwen3_moe", "Qwen3MoeForCausalLM"),
    "gemma3": ("gemma3_text", "Gemma3ForCausalLM"),
}
# GGUF metadata key (after "<arch>.") -> Hugging Face config key, for the config view of a GGUF file.
_GGUF_CONFIG_KEYS: Mapping[str, str] = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "block_count": "num_hidden_layers",
    "feed_forward_length": "intermediate_size",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
    "rope.freq_base": "rope_theta",
    "vocab_size": "vocab_size",
}


@dataclass(frozen=True)
class TargetInfo:
    """A checkpoint's identity and limits, as the configuration rules need them."""

    architectures: tuple[str, ...]
    model_type: str
    vocab_size: int | None
    # The longest sequence the checkpoint supports (max_position_embeddings or the like, extended
    # by its RoPE scaling factor); None when the config does not say.
    max_position_embeddings: int | None
    # The engine's tensor-parallel size for this model (not a property of the checkpoint).
    tensor_parallel_size: int = 1
    # The engine's pipeline stages (always 1 today: the engine refuses more); methods that cannot
    # run on a pipeline (DSpark) check it, for when pipeline parallelism exists.
    pipeline_parallel_size: int = 1
    # The raw config (config.json, or the equivalent keys of a GGUF file's metadata).
    hf_config: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)
    # Where the config was read from, for messages.
    source: str = ""

    @classmethod
    def from_hf_config(
        cls, config: Mapping[str, Any], *, tensor_parallel_size: int = 1, source: str = ""
    ) -> TargetInfo:
        """From a config.json dict; multimodal configs are read through their ``text_config``.

        A quantization the checkpoint readers cannot dequantize is a :class:`ConfigError` here, so
        it fails the configuration check instead of the weight loading.
        """
        checkpoint_quantization(config, source=source)
        text = config.get("text_config")
        text = text if isinstance(text, Mapping) else {}

        def lookup(key: str) -> Any:
            value = config.get(key)
            return value if value is not None else text.get(key)

        return cls(
            architectures=tuple(config.get("architectures") or ()),
            model_type=str(config.get("model_type", "")),
            vocab_size=_positive_int(lookup("vocab_size")),
            max_position_embeddings=_length_limit(config, text),
            tensor_parallel_size=tensor_parallel_size,
            hf_config=dict(config),
            source=source,
        )

    @classmethod
    def from_model_dir(cls, path: str | Path, *, tensor_parallel_size: int = 1) -> TargetInfo:
        """From ``path/config.json`` (``path`` may also be the config.json file itself)."""
        path = Path(path)
        config_file = path if path.is_file() else path / "config.json"
        try:
            config = json.loads(config_file.read_text(encoding="utf-8"))
        except FileNotFoundError:
            raise ConfigError(
                "model",
                f"{str(path)!r} has no config.json",
                "pass a folder that holds config.json, a .gguf file or a Hugging Face repository id",
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(
                "model",
                f"{str(config_file)!r} is not valid JSON ({exc})",
                "repair the file or download the checkpoint again",
            ) from None
        if not isinstance(config, dict):
            raise ConfigError(
                "model", f"{str(config_file)!r} does not hold a JSON object", "download the checkpoint again"
            )
        return cls.from_hf_config(config, tensor_parallel_size=tensor_parallel_size, source=str(config_file))

    @classmethod
    def from_gguf(cls, path: str | Path, *, tensor_parallel_size: int = 1) -> TargetInfo:
        """From a GGUF file's metadata (its tensors are not read)."""
        return cls.from_hf_config(
            _gguf_as_hf_config(Path(path)), tensor_parallel_size=tensor_parallel_size, source=str(path)
        )

    @classmethod
    def from_model(
        cls, model: str | None, *, revision: str | None = None, tensor_parallel_size: int = 1, field: str = "model"
    ) -> TargetInfo:
        """From any model reference; see :func:`target_info_for`."""
        return target_info_for(model, revision=revision, tensor_parallel_size=tensor_parallel_size, field=field)

    def with_parallelism(self, tensor_parallel_size: int, pipeline_parallel_size: int) -> TargetInfo:
        """This target as an engine of these sizes runs it."""
        return replace(self, tensor_parallel_size=tensor_parallel_size, pipeline_parallel_size=pipeline_parallel_size)

    def config_value(self, key: str) -> Any:
        """A key of the raw config, or of its ``text_config`` for multimodal configs (None if absent)."""
        value = self.hf_config.get(key)
        text = self.hf_config.get("text_config")
        if value is None and isinstance(text, Mapping):
            value = text.get(key)
        return value

    @property
    def hidden_size(self) -> int | None:
        return _positive_int(self.config_value("hidden_size"))

    @property
    def num_layers(self) -> int | None:
        return _positive_int(self.config_value("num_hidden_layers"))

    @property
    def checkpoint_folder(self) -> Path | None:
        """The Hugging Face folder the config was read from (None for a GGUF file or a bare config):
        where weights a proposer finds inside the target (MTP layers, embedded drafts) live."""
        return Path(self.source).parent if self.source.endswith("config.json") else None


def target_info_for(
    model: str | None,
    *,
    revision: str | None = None,
    tensor_parallel_size: int = 1,
    field: str = "model",
    revision_field: str = "revision",
) -> TargetInfo:
    """The :class:`TargetInfo` of ``model`` without loading its weights.

    ``model`` is resolved as the model loader resolves it: ``None`` is the embedded default model,
    a path is read directly (folder with config.json, a .gguf file or a folder with one), and a
    repository id at ``revision`` comes from the local Hugging Face cache or has its config files
    downloaded. Failures are a :class:`ConfigError` on ``field`` (on ``revision_field`` for an
    unknown revision).
    """
    try:
        path = Path(model).expanduser() if model is not None else None
        if path is None or not path.exists():
            path = _resolve(model, revision, revision_field)
        return _from_path(path, tensor_parallel_size)
    except ConfigError as exc:
        raise exc if exc.field == revision_field else _on_field(exc, field) from None


def _resolve(model: str | None, revision: str | None, revision_field: str) -> Path:
    try:
        return Path(resolve_model_path(model, revision, CONFIG))
    except HubError as exc:
        raise ConfigError(revision_field if exc.about_revision else "model", exc.problem, exc.fix) from None
    except (OSError, ValueError) as exc:
        if model is None:  # the embedded default model is not installed; the loader says how to install it
            raise ConfigError("model", str(exc), "install the default model, or pass MODEL") from None
        raise


def _from_path(path: Path, tensor_parallel_size: int) -> TargetInfo:
    if path.is_file():
        if path.suffix == ".gguf":
            return TargetInfo.from_gguf(path, tensor_parallel_size=tensor_parallel_size)
        return TargetInfo.from_model_dir(path, tensor_parallel_size=tensor_parallel_size)
    if (path / "config.json").is_file():
        return TargetInfo.from_model_dir(path, tensor_parallel_size=tensor_parallel_size)
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return TargetInfo.from_gguf(ggufs[0], tensor_parallel_size=tensor_parallel_size)
    found = f"{len(ggufs)} .gguf files" if ggufs else "neither config.json nor a .gguf file"
    raise ConfigError(
        "model",
        f"the folder {str(path)!r} holds {found}",
        "pass a folder with config.json, or the path of one .gguf file",
    )


def _on_field(error: ConfigError, field: str) -> ConfigError:
    if error.field == field:
        return error
    return ConfigError(field, error.message, error.fix, detail=error.detail, also=error.also)


def _positive_int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _length_limit(config: Mapping[str, Any], text: Mapping[str, Any]) -> int | None:
    view = {**config, **text}
    lengths = [n for n in (_positive_int(view.get(key)) for key in _LENGTH_KEYS) if n is not None]
    if not lengths:
        return None
    limit = min(lengths)
    rope = view.get("rope_scaling") or view.get("rope_parameters")
    if isinstance(rope, Mapping) and isinstance(rope.get("factor"), int | float):
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type not in _ROPE_TYPES_WITHOUT_EXTENSION:
            if rope_type == "yarn":
                limit = _positive_int(rope.get("original_max_position_embeddings")) or limit
            limit = int(limit * rope["factor"])
    return limit


def _gguf_as_hf_config(path: Path) -> dict[str, Any]:
    """The config.json equivalent of a GGUF file's metadata, cached: parsing the metadata of a
    50k-token vocabulary takes seconds (the gguf reader walks every token string), and every
    configuration check needs it, so the result is kept under ``$SONAR_CACHE_DIR/gguf-metadata``
    keyed by the file's path, size and modification time."""
    entry = cache_root() / "gguf-metadata" / f"{file_cache_key(path)}.json"
    return cached_json(entry, lambda: _read_gguf_metadata(path))


def _read_gguf_metadata(path: Path) -> dict[str, Any]:
    from gguf import GGUFReader

    try:
        reader = GGUFReader(path)
    except (OSError, ValueError) as exc:
        raise ConfigError("model", f"{str(path)!r} is not a readable GGUF file ({exc})", "pass a complete GGUF file (download it again if it was cut short)") from None

    def value(key: str) -> Any:
        entry = reader.fields.get(key)
        return entry.contents() if entry is not None else None

    arch = str(value("general.architecture") or "")
    model_type, architecture = _GGUF_ARCHITECTURES.get(arch, (arch, ""))
    config: dict[str, Any] = {"model_type": model_type, "architectures": [architecture] if architecture else []}
    for gguf_key, hf_key in _GGUF_CONFIG_KEYS.items():
        found = value(f"{arch}.{gguf_key}")
        if found is not None:
            config[hf_key] = found
    if "vocab_size" not in config:
        tokens = reader.fields.get("tokenizer.ggml.tokens")
        if tokens is not None:
            config["vocab_size"] = len(tokens.data)
    for name in ("bos_token_id", "eos_token_id"):
        found = value(f"tokenizer.ggml.{name}")
        if found is not None:
            config[name] = found
    return config
