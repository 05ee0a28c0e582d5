"""The registry of speculation methods that plugins fill through ``sonar_register_methods``."""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from sonar_core.errors import ConfigError, DuplicateMethodError

if TYPE_CHECKING:
    from sonar_core.spec_decode.proposer import Proposer, ProposerContext


@dataclass(frozen=True)
class DraftArchitecture:
    """A draft checkpoint format a method loads: one row of the supported-model table.

    ``architecture`` is matched against the draft config's ``architectures``; ``layout`` names the
    published layout (``"SafeAILab EAGLE-3"``, ``"speculators eagle3"``); ``notes`` says what else
    the method requires of such a checkpoint (a ``model_type`` of its inner layer config, ...).
    A legacy layout whose config names no architecture is matched by ``config_key`` instead (a key
    only its configs have, such as FasterDecoding Medusa's ``medusa_num_heads``).
    ``for_targets`` names the target architectures the format serves (Gemma 4 MTP assistants serve
    Gemma 4 targets only); empty means any target. For a target that no format of a method serves,
    core does not judge ``model``'s architecture: the method's own rule says why it takes none.
    """

    architecture: str
    layout: str
    notes: str = ""
    config_key: str | None = None
    for_targets: tuple[str, ...] = ()

    def serves(self, target_architectures: Sequence[str] | None) -> bool:
        """Whether this format drafts for a target of ``target_architectures`` (unknown: yes)."""
        return not self.for_targets or not target_architectures or any(
            name in self.for_targets for name in target_architectures
        )


@dataclass(frozen=True)
class MethodSpec:
    """One speculation method as a plugin provides it.

    ``create_proposer(context, weights)`` builds the proposer; ``options_model`` is a pydantic model
    (``extra="forbid"``) of the method's own options beyond the documented core fields; unknown keys
    are rejected with the key and the method named. ``draft_architectures`` lists the draft
    checkpoint formats the method loads (empty for methods without a draft checkpoint); a ``model``
    of any other architecture is refused while the configuration is checked, before anything loads.
    ``target_architectures`` lists targets whose checkpoint carries the method's weights itself.
    """

    name: str
    create_proposer: Callable[[ProposerContext, dict[str, Any] | None], Proposer]
    description: str = ""
    options_model: type[BaseModel] | None = None
    draft_architectures: tuple[DraftArchitecture, ...] = ()
    # The method-specific core fields it reads (sonar_core.config.METHOD_SPECIFIC_FIELDS:
    # prompt_lookup_min/max, use_heterogeneous_vocab, attention_backend, parallel_drafting,
    # draft_tensor_parallel_size). Setting one it does not list is warned about: no effect.
    core_fields: frozenset[str] = frozenset()
    # Target architectures whose own checkpoint carries this method's weights (MTP layers shipped
    # with the target): the method runs on them without a ``model``. Listed in the supported-model
    # table; the plugin's own check decides what a target needs.
    target_architectures: tuple[DraftArchitecture, ...] = ()
    # True when the draft checkpoint's own context limit (max_position_embeddings) bounds drafting:
    # unset, speculation's max_model_len is then that limit. False for heads that read target
    # positions whatever their config states (EAGLE) or none at all (Medusa).
    checkpoint_limits_context: bool = False
    # Filled in by the registry from the plugin's distribution.
    distribution: str = field(default="", compare=False)
    version: str = field(default="", compare=False)


# The old model-family names of ``mtp`` (vLLM's list), kept so that existing configurations keep
# working; the MTP plugin registers them as aliases and core names its package when it is missing.
MTP_LEGACY_METHOD_NAMES: tuple[str, ...] = (
    "deepseek_mtp",
    "dots3_note_mtp",
    "mimo_mtp",
    "mimo_v2_mtp",
    "glm4_moe_mtp",
    "glm4_moe_lite_mtp",
    "glm_ocr_mtp",
    "glm5_next_mtp",
    "ernie_mtp",
    "nemotron_h_mtp",
    "exaone_moe_mtp",
    "exaone4_5_mtp",
    "qwen3_next_mtp",
    "qwen4_exp_mtp",
    "qwen3_5_mtp",
    "longcat_flash_mtp",
    "bailing_hybrid_mtp",
    "bailing_hybrid_v3_mtp",
    "minimax_m3_mtp",
    "kimi_k3_mtp",
    "pangu_ultra_moe_mtp",
    "step3p5_mtp",
    "hy_v3_mtp",
    "hy_v4_mtp",
    "gemma4_mtp",
    "inkling_mtp",
)

# Sonar's own method names (every method of the user documentation, plus the old MTP names) and the
# distribution that provides each: an unknown method that appears here gets "pip install <package>"
# as its fix. This is the one place that knows which package owns which of Sonar's methods.
SONAR_METHOD_PACKAGES: Mapping[str, str] = MappingProxyType(
    {
        "mtp": "sonar-mtp",
        **dict.fromkeys(MTP_LEGACY_METHOD_NAMES, "sonar-mtp"),
        "dspark": "sonar-dspark",
        "dflash": "sonar-dflash",
        "eagle": "sonar-eagle",
        "eagle3": "sonar-eagle",
        "extract_hidden_states": "sonar-extract-hidden-states",
        "draft_model": "sonar-draft-model",
        "mlp_speculator": "sonar-mlp-speculator",
        "medusa": "sonar-medusa",
        "ngram": "sonar-ngram",
        "ngram_gpu": "sonar-ngram",
        "suffix": "sonar-suffix",
        "custom_class": "sonar-core",
    }
)


def install_command(package: str, *, reinstall: bool = False) -> str:
    """How to install one of Sonar's distributions. They are not published on a package index
    yet: each installs from its folder of a Sonar checkout (``plugins/<name>``, the checkout
    itself for sonar-core), which is what this says, so that no hint names a package pip cannot
    find."""
    folder = "." if package == "sonar-core" else f"plugins/{package}"
    flags = "--force-reinstall " if reinstall else ""
    return f"pip install {flags}-e {folder} (in a Sonar checkout; {package} installs from that folder)"


class MethodRegistry:
    """Every speculation method of this process, by name and by alias.

    Plugins fill it through ``sonar_register_methods``; the plugin manager wraps each plugin's call
    in :meth:`registering_for` so that every :class:`MethodSpec` carries the distribution and
    version that provide it, and a clash names both distributions.
    """

    def __init__(self) -> None:
        self._methods: dict[str, MethodSpec] = {}
        self._aliases: dict[str, str] = {}
        # Aliases that are old names of their method: accepted with a deprecation warning.
        self._old_names: set[str] = set()
        self._source: tuple[str, str] | None = None
        # Distributions (normalised names) whose entry points were found but not loaded because of
        # the allow-list, with those entry-point names, so that an unknown method can say why it is
        # missing.
        self.not_loaded: dict[str, str] = {}
        # Distributions (normalised names) whose plugin failed to import: (who, the error).
        self.failed: dict[str, tuple[str, str]] = {}

    @contextmanager
    def registering_for(self, distribution: str, version: str) -> Iterator[None]:
        """Stamp every registration made inside the block with ``distribution`` and ``version``."""
        previous = self._source
        self._source = (distribution, version)
        try:
            yield
        finally:
            self._source = previous

    def register(self, spec: MethodSpec, aliases: Iterable[str] = (), old_names: Iterable[str] = ()) -> None:
        """Add ``spec`` under ``spec.name``, each alias and each old name.

        ``aliases`` are other names of the method, accepted silently (a short name, a common
        spelling); ``old_names`` are names it replaces, accepted with a warning to write
        ``spec.name`` in new configurations (``deepseek_mtp`` for ``mtp``). Raises
        :class:`~sonar_core.errors.DuplicateMethodError` when a name is already taken (by any
        plugin, this one included); nothing is registered then.
        """
        old_names = list(dict.fromkeys(old_names))
        aliases = [*aliases, *old_names]
        if not isinstance(spec, MethodSpec):
            raise TypeError(f"register() takes a MethodSpec, got {type(spec).__name__}")
        if self._source is not None:
            spec = replace(spec, distribution=self._source[0], version=self._source[1])
        _check_name(spec.name)
        new_aliases = [alias for alias in dict.fromkeys(aliases) if alias != spec.name]
        for name in (spec.name, *new_aliases):
            _check_name(name)
            holder = self.get(name)
            if holder is not None:
                raise DuplicateMethodError(name, _owner(holder), _owner(spec))
        self._methods[spec.name] = spec
        for alias in new_aliases:
            self._aliases[alias] = spec.name
        self._old_names.update(name for name in old_names if name != spec.name)

    def is_old_name(self, name: str) -> bool:
        """Whether ``name`` was registered as an old name of a method (see :meth:`register`)."""
        return name in self._old_names

    def get(self, name: str) -> MethodSpec | None:
        """The method registered under ``name`` or under ``name`` as an alias, or None."""
        return self._methods.get(self._aliases.get(name, name))

    def canonical_name(self, name: str) -> str | None:
        """``name`` itself when it is a method, the method it is an alias of, or None."""
        spec = self.get(name)
        return spec.name if spec is not None else None

    def resolve(self, name: str) -> MethodSpec:
        """The method for ``name`` (method or alias); an unknown name is a :class:`ConfigError`
        that lists the installed methods and, for Sonar's own methods, the package to install."""
        spec = self.get(name)
        if spec is None:
            raise self.unknown_method_error(name)
        return spec

    def methods(self) -> list[MethodSpec]:
        """Every registered method, sorted by name."""
        return [self._methods[name] for name in sorted(self._methods)]

    def names(self) -> list[str]:
        """Every registered method name (aliases excluded), sorted."""
        return sorted(self._methods)

    def old_names_of(self, name: str) -> tuple[str, ...]:
        """The old names among :meth:`aliases_of` ``name``, sorted."""
        return tuple(alias for alias in self.aliases_of(name) if alias in self._old_names)

    def aliases_of(self, name: str) -> tuple[str, ...]:
        """Every other name registered for the method ``name`` (aliases and old names), sorted."""
        return tuple(sorted(alias for alias, target in self._aliases.items() if target == name))

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and self.get(name) is not None

    def __iter__(self) -> Iterator[MethodSpec]:
        return iter(self.methods())

    def __len__(self) -> int:
        return len(self._methods)

    def unknown_method_error(self, name: str, field: str = "speculative_config.method") -> ConfigError:
        """The error for a method name that is neither registered nor an alias."""
        installed = ", ".join(self.names()) or "none"
        package = SONAR_METHOD_PACKAGES.get(name)
        if package is not None and package in self.failed:
            who, error = self.failed[package]
            return ConfigError(
                field,
                f"method {name!r} comes from {package}, which is installed but failed to load ({who}: {error})",
                f"reinstall it: {install_command(package, reinstall=True)}",
            )
        if package is not None and package in self.not_loaded:
            return ConfigError(
                field,
                f"method {name!r} comes from {package}, which is installed but not loaded: the "
                f"SONAR_PLUGINS allow-list leaves out its entry point {self.not_loaded[package]!r}. "
                f"Loaded methods: {installed}",
                f"add {self.not_loaded[package]!r} to SONAR_PLUGINS, or unset SONAR_PLUGINS to load every plugin",
            )
        if package is not None:
            return ConfigError(
                field,
                f"method {name!r} is not installed. Installed methods: {installed}",
                f"install the package that provides it: {install_command(package)}",
            )
        known = {candidate.lower(): candidate for candidate in [*SONAR_METHOD_PACKAGES, *self._methods, *self._aliases]}
        close = difflib.get_close_matches(name.lower(), list(known), n=1)
        hint = ""
        if close:
            match = known[close[0]]
            provider = "" if match in self else f" (from {SONAR_METHOD_PACKAGES[match]}: {install_command(SONAR_METHOD_PACKAGES[match])})"
            hint = f"did you mean {match!r}{provider}? Otherwise, "
        failed = "".join(f"; {who} failed to load ({error})" for who, error in self.failed.values())
        # Plugins the allow-list left out may provide it: their methods are unknown until loaded.
        others = sorted(
            f"{entry_point!r} ({distribution})"
            for distribution, entry_point in self.not_loaded.items()
            if distribution not in SONAR_METHOD_PACKAGES.values()
        )
        if others:
            return ConfigError(
                field,
                f"{name!r} is not a method of the loaded plugins (loaded methods: {installed}{failed}); the "
                f"SONAR_PLUGINS allow-list leaves out installed plugins that may provide it: entry points "
                f"{', '.join(others)}",
                f"{hint}add the entry point of the plugin that provides {name!r} to SONAR_PLUGINS (it lists entry-point "
                "names, which need not equal method names), or unset SONAR_PLUGINS to load every plugin",
            )
        return ConfigError(
            field,
            f"{name!r} is not a speculation method. Installed methods: {installed}{failed}",
            f"{hint}use one of the installed methods, or install the plugin that provides {name!r} "
            "(`aphrodite plugins` lists what is installed)",
        )


def _check_name(name: object) -> None:
    if not isinstance(name, str) or not name or any(ch.isspace() for ch in name):
        raise ValueError(f"a method name or alias must be a non-empty string without spaces, got {name!r}")


def _owner(spec: MethodSpec) -> str:
    if not spec.distribution:
        return "a plugin registered without a distribution"
    return f"{spec.distribution} {spec.version}".strip()
