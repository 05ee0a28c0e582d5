"""Every hook of Sonar's plugin system, in one module.

A plugin is a module (or object) with functions marked ``@hookimpl`` whose names match the specs
below; it is found through the ``sonar`` entry-point group. Each spec says how the results of several
plugins combine.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:
    from pydantic import BaseModel

    from sonar_core.config import SpeculativeConfig, TargetInfo
    from sonar_core.plugins.registry import MethodRegistry
    from sonar_core.spec_decode.proposer import Proposer, ProposerContext

PROJECT_NAME = "sonar"
# The version of the plugin interface: these hook specifications, MethodSpec, the registry and the
# Proposer contract. A minor step (1.1) only adds (a hook, an optional parameter or field with a
# default, a capability) and leaves every plugin written for 1.x working; a major step (2.0) may
# change or remove something and is announced in docs/plugins.md with what to change. Third-party
# packages compare against it, e.g. ``int(PLUGIN_API_VERSION.split(".")[0]) == 1``.
PLUGIN_API_VERSION = "1.1"

hookspec = pluggy.HookspecMarker(PROJECT_NAME)
hookimpl = pluggy.HookimplMarker(PROJECT_NAME)


@hookspec
def sonar_register_methods(registry: MethodRegistry) -> None:
    """Register speculation methods with ``registry.register(MethodSpec(...), aliases=(...),
    old_names=(...))``: aliases are accepted silently, old names with a deprecation warning.

    Called once per plugin manager, for every plugin; each call adds to the same registry. A method
    name or alias that two plugins register is an error naming both distributions.
    """


@hookspec(firstresult=True)
def sonar_resolve_method_alias(method: str, target: TargetInfo | None) -> str | None:
    """Map a method name that is not registered as-is to a canonical one, or return None.

    For aliases that depend on the target (an old model-family name that maps to a generic method).
    Static aliases belong in ``registry.register(..., aliases=...)``; a name mapped here is treated
    as an old name (accepted with a deprecation warning). The first non-None answer wins.
    """


@hookspec
def sonar_validate_speculative_config(
    config: SpeculativeConfig, target: TargetInfo | None, options: BaseModel | None
) -> list[str] | None:
    """Check the rules of the plugin's own methods; ignore configurations of other methods.

    ``options`` is the method's options model as validated (defaults filled in: the same object a
    proposer gets as ``ProposerContext.method_options``), or None for a method without one;
    ``config.method_options`` is the raw dict of those keys as the user wrote them. A hook
    implementation may leave out parameters it does not use.

    Raise :class:`sonar_core.errors.ConfigError` (naming the field and the fix) for an invalid
    configuration; return warnings (one string each) for a valid but doubtful one. Results of all
    plugins are concatenated.
    """


@hookspec(firstresult=True)
def sonar_default_num_speculative_tokens(config: SpeculativeConfig, target: TargetInfo | None) -> int | None:
    """The draft depth of ``config.method`` when the user set no ``num_speculative_tokens``.

    Return it (for example the depth a draft checkpoint was trained for), or None when this plugin
    does not own the method or has no default; then a missing value is an error. The first non-None
    answer wins.
    """


@hookspec
def sonar_claim_target_tensors(config: SpeculativeConfig | None, target: TargetInfo) -> list[str] | None:
    """Name prefixes of draft weights in the *target* checkpoint, which the target model does not load.

    For draft weights shipped inside the target checkpoint (MTP layers, an embedded DSpark head):
    return the prefixes your methods recognise in ``target`` (from its config), whatever method is
    configured (``config`` is None without speculation), so that such a target also runs without
    them. The target loader skips exactly the tensors under these prefixes and stays strict for
    every other name; your method reads them from ``ProposerContext.target_model_dir``. Return None
    when the target holds none. Results of all plugins are combined.
    """


@hookspec(firstresult=True)
def sonar_load_proposer_weights(
    config: SpeculativeConfig, context: ProposerContext
) -> dict[str, Any] | None:
    """Load the draft weights the configured method needs (from ``config.model`` or the target).

    Return a state dict, or None when this plugin does not own ``config.method``. The first non-None
    answer wins; its result is handed to the method's proposer factory.
    """


@hookspec(firstresult=True)
def sonar_create_proposer(
    config: SpeculativeConfig, context: ProposerContext, weights: dict[str, Any] | None
) -> Proposer | None:
    """Build the proposer for ``config.method``, or return None when this plugin does not own it.

    The default implementation in core builds it from the registered ``MethodSpec.create_proposer``;
    a plugin overrides it only when construction needs more than the method's factory.
    """
