"""A checkpoint's transformers config, kept resolved under ``$SONAR_CACHE_DIR/hf-config``.

``AutoConfig`` is the slowest part of starting an engine on a small model: it imports transformers'
model registry (which scans the source of every model family it ships) and, through the family's
config module, ``torch.distributed.tensor``, over 2 s on a 2-core machine. What it returns is data:
the file's values with the family's defaults filled in and its rope parameters standardised, which
``to_dict()`` writes out whole. So the first read of a config.json saves that dictionary, and later
starts rebuild from it a ``PreTrainedConfig`` (the base class, cheap to import) carrying the same
attributes.

A family's config class can add what such a rebuild loses (attribute aliases, sub-configs,
properties that derive values). That is found out when an entry would be written: the rebuild is
compared with the real config attribute by attribute, and only a config whose rebuild is identical
is cached; any other keeps being read through ``AutoConfig`` every time.
"""

from __future__ import annotations

import inspect
import json
from importlib.metadata import version
from pathlib import Path
from typing import Any

from sonar_core.model_files import cache_root, cached_json, file_cache_key

# Bumped when what an entry holds changes, so that older entries are not read as new ones.
_FORMAT = "1"
# Attributes a rebuild may lack or hold differently because Sonar never reads them: transformers'
# own tensor-, pipeline- and expert-parallel plans (class-level, for its own model code), and the
# per-layer view, which is a window onto the config itself (equal when the config is).
_NOT_COMPARED = frozenset(
    {"base_model_tp_plan", "base_model_pp_plan", "base_model_ep_plan", "per_layer_config"}
)


def read_hf_config(model_dir: Path) -> Any:
    """The transformers config of ``model_dir``: rebuilt from the cache when an entry for this
    config.json (its path, size and modification time) and this transformers version exists, else
    read with ``AutoConfig`` (and cached when a rebuild reproduces it)."""
    loaded: list[Any] = []

    def resolve() -> dict[str, Any] | None:
        config = read_with_auto_config(model_dir)
        loaded.append(config)
        return cacheable_values(config)

    values = cached_json(entry_path(model_dir), resolve)
    return loaded[0] if loaded else rebuild(values)


def entry_path(model_dir: Path) -> Path:
    """Where the entry for ``model_dir``'s config.json (its path, size and modification time) and
    this transformers version is kept."""
    key = file_cache_key(Path(model_dir) / "config.json", version("transformers"), _FORMAT)
    return cache_root() / "hf-config" / f"{key}.json"


def read_with_auto_config(model_dir: Path) -> Any:
    """The config as transformers' ``AutoConfig`` reads it, as an instance of the family's class:
    for what picks code by the config's class rather than its values (``AutoTokenizer`` when the
    tokenizer files do not name their class)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir, local_files_only=True)


def is_rebuilt(config: Any) -> bool:
    """Whether ``config`` came from the cache (a base-class config, not its family's class)."""
    kind = type(config)
    return kind.__name__ == "PreTrainedConfig" and kind.__module__ == "transformers.configuration_utils"


def rebuild(values: dict[str, Any]) -> Any:
    """A base-class transformers config with ``values`` (a ``to_dict()``) as its attributes."""
    from transformers.configuration_utils import PreTrainedConfig

    config = PreTrainedConfig(**values)
    for name, value in values.items():  # what the base class's __init__ drops (``use_cache``)
        is_property = isinstance(inspect.getattr_static(PreTrainedConfig, name, None), property)
        if name not in vars(config) and not is_property:
            setattr(config, name, value)
    return config


def cacheable_values(config: Any) -> dict[str, Any] | None:
    """``config.to_dict()`` as JSON data when :func:`rebuild` of it is faithful to ``config``;
    None when it is not (or when the values are not JSON)."""
    try:
        values = json.loads(json.dumps(config.to_dict()))
    except (TypeError, ValueError):
        return None
    return values if _is_faithful(config, rebuild(values)) else None


def _is_faithful(real: Any, rebuilt: Any) -> bool:
    """Whether every attribute of ``real`` reads the same on ``rebuilt``.

    Data (the instance's and the family class's) is compared by value. Methods and properties the
    family inherits from the base class are the same code on both, computing from the compared
    data, so they are not called (some of them only log a deprecation). A method the family
    overrides disqualifies the config, apart from its construction-time ``validate*`` checks; a
    property it adds is compared by value.
    """
    family, base = type(real), type(rebuilt)
    for name in (set(dir(real)) | set(dir(rebuilt))) - _NOT_COMPARED:
        if name.startswith("__"):
            continue
        ours, theirs = inspect.getattr_static(family, name, None), inspect.getattr_static(base, name, None)
        code = callable(ours) or isinstance(ours, property | staticmethod | classmethod)
        if code and ours is theirs:
            continue
        if code and not isinstance(ours, property):
            if name.startswith("validate"):
                continue
            return False
        try:
            if _attribute(real, name) != _attribute(rebuilt, name):
                return False
        except Exception:  # values that cannot be compared are not known to be equal
            return False
    return True


_MISSING = object()


def _attribute(config: Any, name: str) -> Any:
    try:
        return getattr(config, name)
    except Exception:  # a property that raises on one side counts as missing there
        return _MISSING
