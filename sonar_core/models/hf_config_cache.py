"""A checkpoint's transformers config, kept resolved under ``$SONAR_CACHE_DIR/hf-config``.

``AutoConfig`` is the slowest part of starting an engine on a small model: it imports transformers'
model registry (which scans the source of every model family it ships) and, through the family's
config module, ``torch.distributed.tensor``, over 2 s on a 2-core machine. What it returns is data:
the file's values with the family's defaults filled in and its rope parameters standardised, which
``to_dict()`` writes out whole. So the first read of a config.json saves that dictionary, and later
starts rebuild from it a ``PreTrainedConfig`` (the base class) carrying the same attributes.

Even the base class costs a start 0.6-0.8 s on such a machine, for importing transformers at all.
So an entry also keeps what that rebuild's attributes read (those that are JSON data), and a start
builds a :class:`CachedConfig` from them, which imports nothing; the base-class rebuild is made
only when a method or property of it is asked for.

A family's config class can add what such a rebuild loses (attribute aliases, sub-configs,
properties that derive values). That is found out when an entry would be written: the rebuild is
compared with the real config attribute by attribute, and only a config whose rebuild is identical
is cached; any other keeps being read through ``AutoConfig`` every time.
"""

from __future__ import annotations

import hashlib
import inspect
import json
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

from sonar_core.model_files import cache_root, cached_json, file_cache_key

# Bumped when what an entry holds changes, so that older entries are not read as new ones.
_FORMAT = "2"
# Attributes a rebuild may lack or hold differently because Sonar never reads them: transformers'
# own tensor-, pipeline- and expert-parallel plans (class-level, for its own model code), the
# per-layer view, which is a window onto the config itself (equal when the config is), and the
# version that wrote the config (None on one made from a dictionary, which ``to_dict`` fills in).
_NOT_COMPARED = frozenset(
    {
        "base_model_tp_plan",
        "base_model_pp_plan",
        "base_model_ep_plan",
        "per_layer_config",
        "transformers_version",
    }
)


def read_hf_config(model_dir: Path) -> Any:
    """The transformers config of ``model_dir``: a :class:`CachedConfig` from the entry for this
    config.json (its path, size and modification time) and this transformers version when there is
    one, else read with ``AutoConfig`` (and kept when a rebuild reproduces it)."""
    return _cached(entry_path(model_dir), lambda: read_with_auto_config(model_dir))


def config_of_values(values: dict[str, Any], build: Callable[[], Any]) -> Any:
    """What ``build()`` returns for ``values``, a config transformers makes from a dictionary (a
    draft head's layer config, through ``AutoConfig.for_model``), kept as a checkpoint's config is,
    under an entry keyed by the values themselves and this transformers version."""
    try:
        identity = json.dumps([values, version("transformers"), _FORMAT], sort_keys=True)
    except (TypeError, ValueError):
        return build()
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return _cached(cache_root() / "hf-config" / f"values-{digest}.json", build)


def _cached(path: Path, read: Callable[[], Any]) -> Any:
    """The config ``read()`` returns, from the entry at ``path`` when there is one (written after
    the first read when the config can be kept)."""
    loaded: list[Any] = []

    def resolve() -> dict[str, Any] | None:
        loaded.append(read())
        return cache_entry(loaded[0])

    entry = cached_json(path, resolve)
    return loaded[0] if loaded else CachedConfig(entry)


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
    """Whether ``config`` came from the cache (not an instance of its family's class)."""
    return type(config) is CachedConfig


def transformers_config(config: Any) -> Any:
    """``config`` as a transformers config, for what hands it to transformers: a
    :class:`CachedConfig`'s base-class rebuild, any other config itself."""
    return config.transformers_config if type(config) is CachedConfig else config


class CachedConfig:
    """A checkpoint's config read from the cache without importing transformers.

    Its attributes are what the base-class rebuild of the entry's values reads, name by name, for
    every name whose value is JSON data (what model code reads: sizes, ids, rope parameters). A
    method or property of the base class, or a value JSON cannot hold exactly (tuples, integer
    keys), is read from that rebuild, made on first such read; a name the rebuild lacks raises
    ``AttributeError`` at once, as it would there. ``get_text_config`` answers itself, which is what
    the rebuild answers for every config the cache keeps.
    """

    def __init__(self, entry: dict[str, Any]) -> None:
        self.__dict__.update(entry["attributes"])
        self._sonar_values: dict[str, Any] = entry["values"]
        self._sonar_delegated = frozenset(entry["delegated"])
        self._sonar_rebuilt: Any = None

    @property
    def transformers_config(self) -> Any:
        """The base-class transformers config these values rebuild (imports transformers)."""
        if self._sonar_rebuilt is None:
            self._sonar_rebuilt = rebuild(self._sonar_values)
        return self._sonar_rebuilt

    def get_text_config(self, *args: Any, **kwargs: Any) -> CachedConfig:
        return self

    def __getattr__(self, name: str) -> Any:
        if name.startswith(("__", "_sonar_")) or name not in self._sonar_delegated:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(self.transformers_config, name)

    def __repr__(self) -> str:
        return f"CachedConfig({self._sonar_values!r})"


def rebuild(values: dict[str, Any]) -> Any:
    """A base-class transformers config with ``values`` (a ``to_dict()``) as its attributes."""
    from transformers.configuration_utils import PreTrainedConfig

    config = PreTrainedConfig(**values)
    for name, value in values.items():  # what the base class's __init__ drops (``use_cache``)
        is_property = isinstance(inspect.getattr_static(PreTrainedConfig, name, None), property)
        if name not in vars(config) and not is_property:
            setattr(config, name, value)
    return config


def cache_entry(config: Any) -> dict[str, Any] | None:
    """What the cache keeps of ``config``: ``config.to_dict()`` as JSON data (``values``), what the
    rebuild of those values reads for each JSON-data attribute (``attributes``) and the names it
    answers otherwise (``delegated``). None when the rebuild is not faithful to ``config``, when
    it is a composite config (``get_text_config`` not itself), or when the values are not JSON."""
    try:
        values = json.loads(json.dumps(config.to_dict()))
    except (TypeError, ValueError):
        return None
    rebuilt = rebuild(values)
    if not _is_faithful(config, rebuilt):
        return None
    text_configs = (
        rebuilt.get_text_config(),
        rebuilt.get_text_config(decoder=True),
        rebuilt.get_text_config(encoder=True),
    )
    if any(text_config is not rebuilt for text_config in text_configs):
        return None
    attributes, delegated = _split_attributes(rebuilt)
    return {"values": values, "attributes": attributes, "delegated": delegated}


def _split_attributes(rebuilt: Any) -> tuple[dict[str, Any], list[str]]:
    """The attributes of ``rebuilt`` that are data JSON holds exactly, and the names of the rest
    (methods, properties, other values)."""
    attributes: dict[str, Any] = {}
    delegated: list[str] = []
    for name in dir(rebuilt):
        if name.startswith("__"):
            continue
        static = None if name in vars(rebuilt) else inspect.getattr_static(type(rebuilt), name, None)
        if callable(static) or isinstance(static, property | staticmethod | classmethod):
            delegated.append(name)
            continue
        value = _attribute(rebuilt, name)
        if value is not _MISSING and _json_exact(value):
            attributes[name] = value
        else:
            delegated.append(name)
    return attributes, delegated


def _json_exact(value: Any) -> bool:
    """Whether ``value`` comes back from JSON equal and of the same types (no tuples, no integer
    keys, no NaN)."""
    try:
        copy = json.loads(json.dumps(value))
    except (TypeError, ValueError):
        return False
    return copy == value and repr(copy) == repr(value)


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
