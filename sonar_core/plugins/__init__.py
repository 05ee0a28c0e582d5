"""Sonar's plugin system: pluggy hooks, found through the ``sonar`` entry-point group.

A plugin is a module with ``@hookimpl`` functions (see :mod:`sonar_core.plugins.hookspecs`),
named by an entry point in its distribution's ``pyproject.toml``::

    [project.entry-points.sonar]
    my_method = "my_package.plugin"

Importing this package has no side effects; :func:`get_plugin_manager` builds a manager when called.
See docs/plugins.md.
"""

from sonar_core.plugins.hookspecs import PLUGIN_API_VERSION, hookimpl, hookspec
from sonar_core.plugins.manager import (
    ALLOW_LIST_ENV,
    ENTRY_POINT_GROUP,
    TRACE_ENV,
    PluginSource,
    SonarPluginManager,
    build_method_registry,
    enable_hook_tracing,
    get_plugin_manager,
)
from sonar_core.plugins.registry import (
    MTP_LEGACY_METHOD_NAMES,
    SONAR_METHOD_PACKAGES,
    DraftArchitecture,
    MethodRegistry,
    MethodSpec,
    install_command,
)
from sonar_core.plugins.rules import (
    checkpoint_refused,
    checkpoint_required,
    non_causal_backend_refused,
    one_hot_drafts_warning,
    parallel_drafting_refused,
)

__all__ = [
    "PLUGIN_API_VERSION",
    "ALLOW_LIST_ENV",
    "ENTRY_POINT_GROUP",
    "MTP_LEGACY_METHOD_NAMES",
    "SONAR_METHOD_PACKAGES",
    "install_command",
    "TRACE_ENV",
    "MethodRegistry",
    "DraftArchitecture",
    "MethodSpec",
    "PluginSource",
    "SonarPluginManager",
    "build_method_registry",
    "checkpoint_refused",
    "checkpoint_required",
    "enable_hook_tracing",
    "get_plugin_manager",
    "hookimpl",
    "hookspec",
    "non_causal_backend_refused",
    "one_hot_drafts_warning",
    "parallel_drafting_refused",
]
