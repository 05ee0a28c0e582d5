"""The plugin manager: built explicitly, once per process, from the ``sonar`` entry points.

Nothing happens at import. :func:`get_plugin_manager` creates a pluggy manager with Sonar's hook
specifications, loads every entry point of the group ``sonar`` (Sonar's own methods included, so
built-in and third-party methods are found the same way), honours the ``SONAR_PLUGINS`` allow-list
and the ``SONAR_TRACE_HOOKS`` trace switch, checks for misspelt hooks, and fills the method
registry.

A plugin whose import fails is left out with a warning that names it, its error and the fix, so
that one broken installation does not stop engines that never use it; asking for a method it
would have provided is an error that carries the import failure.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any

import pluggy

from sonar_core.errors import ConfigError, PluginError
from sonar_core.plugins import hookspecs
from sonar_core.plugins.hookspecs import PROJECT_NAME, hookimpl
from sonar_core.plugins.registry import MethodRegistry, MethodSpec

if TYPE_CHECKING:
    from pydantic import BaseModel

    from sonar_core.config import ResolvedSpeculativeConfig, SpeculativeConfig, TargetInfo
    from sonar_core.spec_decode.proposer import Proposer, ProposerContext

ENTRY_POINT_GROUP = "sonar"
# Comma-separated entry-point names to load; empty loads none; unset loads all.
ALLOW_LIST_ENV = "SONAR_PLUGINS"
# "1" (or true/yes/on) logs every hook call and its result to the logger "sonar.plugins".
TRACE_ENV = "SONAR_TRACE_HOOKS"
CORE_PLUGIN_NAME = "sonar-core:defaults"

logger = logging.getLogger("sonar.plugins")

_LONGEST_TRACED_VALUE = 120


@dataclass(frozen=True)
class PluginSource:
    """Where a plugin comes from: its entry-point name and the distribution that provides it."""

    name: str
    distribution: str
    version: str
    # The entry point's target ("package.module"), empty for plugins registered directly.
    value: str = ""

    def describe(self) -> str:
        if not self.distribution:
            return f"plugin {self.name!r}"
        return f"plugin {self.name!r} of {self.distribution} {self.version}".rstrip()


class SonarPluginManager(pluggy.PluginManager):
    """A pluggy manager that knows each plugin's distribution and holds the method registry."""

    def __init__(self) -> None:
        super().__init__(PROJECT_NAME)
        self.add_hookspecs(hookspecs)
        self.sources: dict[str, PluginSource] = {}
        # Entry points found but left out by the allow-list.
        self.not_loaded: list[PluginSource] = []
        # Entry points whose import failed, with the error ("ModuleNotFoundError: ...").
        self.failed: list[tuple[PluginSource, str]] = []
        self._registry: MethodRegistry | None = None

    def register_plugin(self, plugin: object, source: PluginSource) -> None:
        """Register ``plugin`` under ``source.name``; a clash or a bad hook is a PluginError."""
        if self.has_plugin(source.name):
            other = self.source_of(source.name)
            raise PluginError(
                f"two plugins use the entry-point name {source.name!r}: {other.describe()} and "
                f"{source.describe()}. Fix: uninstall one of the two distributions."
            )
        if self.is_registered(plugin):
            other = self.source_of(self.get_name(plugin) or "")
            raise PluginError(
                f"{other.describe()} and {source.describe()} load the same plugin ({source.value or plugin!r}). "
                "Fix: uninstall one of the two distributions."
            )
        try:
            self.register(plugin, name=source.name)
        except pluggy.PluginValidationError as exc:
            raise PluginError(
                f"{source.describe()} does not match Sonar's hook specifications: {exc}. "
                "Fix: update the plugin to this version of sonar-core (docs/plugins.md lists the hooks)."
            ) from exc
        self.sources[source.name] = source

    def source_of(self, name: str) -> PluginSource:
        """The source of the plugin registered as ``name`` (a bare one when it was registered
        without :meth:`register_plugin`)."""
        return self.sources.get(name, PluginSource(name, "", ""))

    @property
    def method_registry(self) -> MethodRegistry:
        """Every method the plugins register (built on first use when not built yet)."""
        if self._registry is None:
            self._registry = build_method_registry(self)
        return self._registry

    # ---- the method catalogue that configuration checks read (sonar_core.config.MethodCatalogue)
    def method_names(self) -> list[str]:
        return self.method_registry.names()

    def resolve_method(self, requested: str, target: TargetInfo | None) -> MethodSpec:
        """The method of a registered name or alias, else of the plugins' alias rules."""
        registry = self.method_registry
        spec = registry.get(requested)
        if spec is not None:
            return spec
        mapped = self.hook.sonar_resolve_method_alias(method=requested, target=target)
        if mapped is None:
            raise registry.unknown_method_error(requested, "speculative_config.method")
        spec = registry.get(mapped)
        if spec is None:
            raise ConfigError(
                "speculative_config.method",
                f"a plugin maps {requested!r} to {mapped!r}, which is not an installed method",
                f"install the plugin that provides {mapped!r}, or use one of: {', '.join(registry.names())}",
            )
        return spec

    def is_old_name(self, requested: str) -> bool:
        """A registered old name, or a name only a plugin's alias rule maps (old model-family names)."""
        registry = self.method_registry
        return registry.is_old_name(requested) or registry.get(requested) is None

    def methods_reading(self, field: str) -> list[str]:
        return [spec.name for spec in self.method_registry.methods() if field in spec.core_fields]

    def methods_for_draft_architecture(self, architecture: str) -> list[str]:
        return [
            spec.name
            for spec in self.method_registry.methods()
            if any(entry.architecture == architecture for entry in spec.draft_architectures)
        ]

    def default_num_speculative_tokens(self, config: SpeculativeConfig, target: TargetInfo | None) -> int | None:
        return self.hook.sonar_default_num_speculative_tokens(config=config, target=target)

    def method_rules(
        self, config: SpeculativeConfig, target: TargetInfo | None, options: BaseModel | None = None
    ) -> list[str]:
        warnings: list[str] = []
        for result in self.hook.sonar_validate_speculative_config(config=config, target=target, options=options):
            if isinstance(result, str):
                warnings.append(result)
            elif result:
                warnings.extend(str(item) for item in result)
        return warnings

    def target_tensor_claims(self, config: SpeculativeConfig | None, target: TargetInfo) -> tuple[str, ...]:
        """Name prefixes of draft weights in the target checkpoint (see the hook)."""
        claims = self.hook.sonar_claim_target_tensors(config=config, target=target)
        return tuple(dict.fromkeys(prefix for result in claims for prefix in result or ()))

    def create_proposer(self, resolved: ResolvedSpeculativeConfig, context: ProposerContext) -> Proposer:
        """Load the method's weights and build its proposer through the hooks."""
        from sonar_core.spec_decode.proposer import Proposer

        weights = self.hook.sonar_load_proposer_weights(config=resolved.config, context=context)
        proposer = self.hook.sonar_create_proposer(config=resolved.config, context=context, weights=weights)
        if not isinstance(proposer, Proposer):
            spec = self.method_registry.get(resolved.method)
            distribution = spec.distribution if spec is not None else ""
            raise PluginError(
                f"method {resolved.method!r} ({distribution or 'unknown distribution'}) "
                f"built {type(proposer).__name__} instead of a sonar_core.spec_decode.proposer.Proposer. "
                "Fix: the method's create_proposer must return a Proposer instance."
            )
        return proposer


class _CoreHooks:
    """Core's default hook implementations, called after every plugin's (trylast)."""

    def __init__(self, manager: SonarPluginManager) -> None:
        self._manager = manager

    @hookimpl(trylast=True)
    def sonar_create_proposer(
        self, config: SpeculativeConfig, context: ProposerContext, weights: dict[str, Any] | None
    ) -> Proposer | None:
        """Build the proposer with the registered ``MethodSpec.create_proposer``."""
        spec = self._manager.method_registry.get(config.method or "")
        if spec is None:
            return None
        return spec.create_proposer(context, weights)


def get_plugin_manager(
    *,
    load_entry_points: bool = True,
    plugins: Iterable[tuple[object, PluginSource]] = (),
    environ: Mapping[str, str] | None = None,
) -> SonarPluginManager:
    """A new plugin manager for this process, with its method registry filled.

    ``plugins`` are registered besides the entry points (tests use it for fakes; they bypass the
    allow-list). ``environ`` replaces ``os.environ`` for ``SONAR_PLUGINS`` and ``SONAR_TRACE_HOOKS``.
    Raises :class:`PluginError` for a misspelt hook or two registrations of one method name; a
    plugin that does not import is left out (``failed``) with a warning.
    """
    env = os.environ if environ is None else environ
    manager = SonarPluginManager()
    if load_entry_points:
        _load_entry_points(manager, parse_allow_list(env.get(ALLOW_LIST_ENV)))
    for plugin, source in plugins:
        manager.register_plugin(plugin, source)
    manager.register(_CoreHooks(manager), name=CORE_PLUGIN_NAME)
    if env.get(TRACE_ENV, "").strip().lower() in {"1", "true", "yes", "on"}:
        enable_hook_tracing(manager)
    _check_pending(manager)
    manager._registry = build_method_registry(manager)
    return manager


def parse_allow_list(value: str | None) -> frozenset[str] | None:
    """``SONAR_PLUGINS`` as a set of entry-point names; None (unset) allows every plugin."""
    if value is None:
        return None
    return frozenset(name.strip() for name in value.split(",") if name.strip())


def build_method_registry(manager: SonarPluginManager) -> MethodRegistry:
    """Call each plugin's ``sonar_register_methods`` in registration order, stamping its source."""
    registry = MethodRegistry()
    for source in manager.not_loaded:
        registry.not_loaded[normalise_distribution(source.distribution)] = source.name
    for source, error in manager.failed:
        registry.failed[normalise_distribution(source.distribution or source.name)] = (source.describe(), error)
    hook = manager.hook.sonar_register_methods
    implementers = {impl.plugin_name: impl.plugin for impl in hook.get_hookimpls()}
    for name, _ in manager.list_name_plugin():
        if name not in implementers:
            continue
        others = [other for other_name, other in implementers.items() if other_name != name]
        source = manager.source_of(name)
        with registry.registering_for(source.distribution, source.version):
            try:
                manager.subset_hook_caller("sonar_register_methods", others)(registry=registry)
            except PluginError:
                raise
            except Exception as exc:
                raise PluginError(
                    f"{source.describe()} failed while registering its methods: {type(exc).__name__}: {exc}. "
                    "Fix: update or reinstall the plugin, or leave it out with SONAR_PLUGINS."
                ) from exc
    return registry


def enable_hook_tracing(manager: pluggy.PluginManager) -> Callable[[], None]:
    """Log every hook call (arguments, implementing plugins, result) to ``sonar.plugins`` at INFO.

    Returns the function that turns tracing off again.
    """

    def before(hook_name: str, hook_impls: Sequence[pluggy.HookImpl], kwargs: Mapping[str, object]) -> None:
        arguments = ", ".join(f"{key}={_short(value)}" for key, value in kwargs.items())
        plugins = ", ".join(impl.plugin_name for impl in reversed(hook_impls)) or "no plugin"
        logger.info("hook %s(%s) -> %s", hook_name, arguments, plugins)

    def after(
        outcome: pluggy.Result[object],
        hook_name: str,
        hook_impls: Sequence[pluggy.HookImpl],
        kwargs: Mapping[str, object],
    ) -> None:
        if outcome.exception is not None:
            logger.info("hook %s raised %s: %s", hook_name, type(outcome.exception).__name__, outcome.exception)
        else:
            logger.info("hook %s returned %s", hook_name, _short(outcome.get_result()))

    return manager.add_hookcall_monitoring(before, after)


def normalise_distribution(name: str) -> str:
    """A distribution name as pip compares them (``Sonar_NGram`` and ``sonar-ngram`` are one)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _load_entry_points(manager: SonarPluginManager, allow: frozenset[str] | None) -> None:
    found = sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda ep: ep.name)
    for entry_point in found:
        source = _source_of(entry_point)
        if allow is not None and entry_point.name not in allow:
            manager.not_loaded.append(source)
            continue
        try:
            plugin = entry_point.load()
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            manager.failed.append((source, error))
            logger.warning(
                "%s (entry point %s = %s) failed to load and is left out: %s. Fix: reinstall it "
                "(pip install --force-reinstall %s), or leave it out with SONAR_PLUGINS=<the entry-point "
                "names to load>.",
                source.describe(), entry_point.name, entry_point.value, error, source.distribution or entry_point.name,
            )
            continue
        manager.register_plugin(plugin, source)
    if allow:
        missing = sorted(allow - {entry_point.name for entry_point in found})
        if missing:
            logger.warning(
                "%s names %s, which no installed distribution provides (installed plugins: %s)",
                ALLOW_LIST_ENV,
                ", ".join(missing),
                ", ".join(entry_point.name for entry_point in found) or "none",
            )


def _source_of(entry_point: EntryPoint) -> PluginSource:
    dist = entry_point.dist
    if dist is None:
        return PluginSource(entry_point.name, "", "", entry_point.value)
    return PluginSource(entry_point.name, dist.metadata["Name"] or dist.name, dist.version, entry_point.value)


def _check_pending(manager: SonarPluginManager) -> None:
    """Reject hook implementations whose name matches no specification (a misspelt hook)."""
    try:
        manager.check_pending()
    except pluggy.PluginValidationError as exc:
        known = sorted(name for name in vars(hookspecs) if name.startswith("sonar_"))
        unknown = [
            (hook_name, impl.plugin_name)
            for hook_name, caller in vars(manager.hook).items()
            if not hook_name.startswith("_") and not caller.has_spec()
            for impl in caller.get_hookimpls()
            if impl.plugin is exc.plugin
        ]
        hook_name, plugin_name = unknown[0] if unknown else ("?", manager.get_name(exc.plugin) or "?")
        close = difflib.get_close_matches(hook_name, known, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise PluginError(
            f"{manager.source_of(plugin_name).describe()} implements {hook_name!r}, which is not a Sonar "
            f"hook. Fix: {hint}the hooks are: {', '.join(known)} (see docs/plugins.md)."
        ) from exc


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _LONGEST_TRACED_VALUE else text[: _LONGEST_TRACED_VALUE - 3] + "..."
