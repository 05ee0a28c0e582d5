"""The tokenizer class ``AutoTokenizer`` picks for a model folder, kept under
``$SONAR_CACHE_DIR/tokenizer-class``.

``AutoTokenizer`` decides the class from tokenizer_config.json and the model's config through
transformers' model registry, whose first import scans the source of every model family it ships
(about half a second of an engine's start on a 2-core machine). For checkpoints saved by current
transformers, and for every GGUF file Sonar converts, the class it picks is a generic one that lives
outside that registry (``TokenizersBackend``). So the first load records the class when loading it
directly gives the same tokenizer (type, init arguments, Rust tokenizer and chat template compared),
and later loads import and call it directly. Classes inside the registry, or from a repository's own
code, are not recorded: loading them needs the registry (or the code) anyway.

The entry also keeps a :mod:`~sonar_core.models.tokenizer_snapshot` of the tokenizer where one
answers exactly as it does: later starts then load no transformers at all, and the class recorded
here (or ``AutoTokenizer``) loads the tokenizer itself only when something beyond the snapshot is
asked of it.
"""

from __future__ import annotations

import importlib
import json
from functools import partial
from importlib.metadata import version
from pathlib import Path
from typing import Any

from sonar_core.hub import TOKENIZER_FILES
from sonar_core.model_files import cache_root, cached_json, file_cache_key, file_identity
from sonar_core.models.hf_config_cache import is_rebuilt, read_with_auto_config, transformers_config
from sonar_core.models.tokenizer_snapshot import SnapshotTokenizer, TokenizerSnapshot, take_snapshot

# Bumped when what an entry holds changes, so that older entries are not read as new ones.
_FORMAT = "2"


def load_with_auto_tokenizer(model_dir: Path, config: Any, trust_remote_code: bool) -> Any:
    """What ``AutoTokenizer.from_pretrained(model_dir, config=config)`` returns (offline), through
    the recorded class when there is one for these files."""
    if not (model_dir / "tokenizer_config.json").is_file():
        return _auto_tokenizer(model_dir, config, trust_remote_code)
    picked: list[Any] = []
    path = entry_path(model_dir)

    def resolve() -> dict[str, Any] | None:
        picked.append(_auto_tokenizer(model_dir, config, trust_remote_code))
        direct = _direct_entry(picked[0], model_dir)
        load_full = _full_loader(direct, model_dir, config, trust_remote_code)
        snapshot = take_snapshot(picked[0], path.with_suffix(".tokenizer.json"), str(model_dir), load_full)
        if direct is None and snapshot is None:
            return None
        return {"direct": direct, "snapshot": snapshot.to_json() if snapshot is not None else None}

    entry = cached_json(path, resolve)
    if picked:
        return picked[0]
    load_full = _full_loader(entry["direct"], model_dir, config, trust_remote_code)
    if entry["snapshot"] is not None:
        snapshot = TokenizerSnapshot.from_json(entry["snapshot"], path.parent)
        if snapshot.backend_file.is_file():
            return SnapshotTokenizer(snapshot, str(model_dir), load_full)
    return load_full()


def _full_loader(
    direct: dict[str, str] | None, model_dir: Path, config: Any, trust_remote_code: bool
) -> partial[Any]:
    """How the transformers tokenizer itself is loaded: its recorded class, else ``AutoTokenizer``
    (a picklable call, since a snapshot tokenizer travels to other processes with it)."""
    if direct is not None:
        return partial(_load_directly, direct, model_dir)
    return partial(_auto_tokenizer, model_dir, config, trust_remote_code)


def _auto_tokenizer(model_dir: Path, config: Any, trust_remote_code: bool) -> Any:
    """``AutoTokenizer`` itself. Where it picks the class by the config's class, a config rebuilt
    from the cache (a base-class config) is replaced by the family's own."""
    from transformers import AutoTokenizer

    if config is not None and is_rebuilt(config):
        config = (
            read_with_auto_config(model_dir)
            if _class_follows_config_class(model_dir)
            else transformers_config(config)
        )
    return AutoTokenizer.from_pretrained(
        str(model_dir), config=config, local_files_only=True, trust_remote_code=trust_remote_code
    )


def _class_follows_config_class(model_dir: Path) -> bool:
    """Whether ``AutoTokenizer`` picks the tokenizer by the model config's class: when
    tokenizer_config.json names no class of its own, or names code (an ``auto_map``)."""
    try:
        tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return True
    if not isinstance(tokenizer_config, dict):
        return True
    return not tokenizer_config.get("tokenizer_class") or "auto_map" in tokenizer_config


def entry_path(model_dir: Path) -> Path:
    """Where the entry for ``model_dir`` is kept: keyed by tokenizer_config.json, config.json (the
    config's model_type takes part in the choice) and every other file a tokenizer is read from
    (the Hub's ``TOKENIZER_FILES``; their path, size and modification time), and the versions of
    transformers, tokenizers and jinja2 (the snapshot is the Rust tokenizer's serialisation and
    renders templates with jinja2). The snapshot's Rust tokenizer is kept beside it, under the same
    name ending in ``.tokenizer.json``."""
    files = [model_dir / name for name in ("config.json", *sorted(TOKENIZER_FILES - {"tokenizer_config.json"}))]
    identities = json.dumps([file_identity(file) if file.is_file() else None for file in files])
    versions = [version(package) for package in ("transformers", "tokenizers", "jinja2")]
    key = file_cache_key(model_dir / "tokenizer_config.json", identities, *versions, _FORMAT)
    return cache_root() / "tokenizer-class" / f"{key}.json"


def _load_directly(entry: dict[str, str], model_dir: Path) -> Any:
    tokenizer_class = getattr(importlib.import_module(entry["module"]), entry["name"])
    return tokenizer_class.from_pretrained(str(model_dir), local_files_only=True)


def _direct_entry(tokenizer: Any, model_dir: Path) -> dict[str, str] | None:
    """The entry for the class of ``tokenizer`` when it is a generic transformers class and loading
    it directly gives the same tokenizer; None otherwise."""
    kind = type(tokenizer)
    if not kind.__module__.startswith("transformers.") or kind.__module__.startswith("transformers.models."):
        return None
    entry = {"module": kind.__module__, "name": kind.__qualname__}
    try:
        direct = _load_directly(entry, model_dir)
    except Exception:  # a class that cannot load these files alone is simply not recorded
        return None
    return entry if _same_tokenizer(tokenizer, direct) else None


def _same_tokenizer(auto: Any, direct: Any) -> bool:
    if type(auto) is not type(direct) or auto.init_kwargs != direct.init_kwargs:
        return False
    if getattr(auto, "chat_template", None) != getattr(direct, "chat_template", None):
        return False
    backend = getattr(auto, "backend_tokenizer", None)
    if backend is None:
        return False
    return backend.to_str() == direct.backend_tokenizer.to_str()
