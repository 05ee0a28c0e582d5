"""What the configuration rules need to know about the installed speculation methods.

Configuration sits below the plugin system: it imports neither the plugin manager nor any plugin.
The rules receive a :class:`MethodCatalogue` instead, and the plugin manager is one (it answers from
its method registry and the plugins' hooks). Tests can hand the rules any object of this shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

from pydantic import BaseModel

if TYPE_CHECKING:
    from sonar_core.config.speculative import SpeculativeConfig
    from sonar_core.config.target import TargetInfo


class DraftArchitectureEntry(Protocol):
    """One draft checkpoint architecture a method can load (a row of the supported-model table)."""

    @property
    def architecture(self) -> str: ...

    @property
    def config_key(self) -> str | None: ...

    def serves(self, target_architectures: Sequence[str] | None) -> bool:
        """Whether the format drafts for a target of these architectures (unknown target: yes)."""


class MethodDescription(Protocol):
    """A method as the rules see it: its canonical name, its options model and its draft formats."""

    @property
    def name(self) -> str: ...

    @property
    def options_model(self) -> type[BaseModel] | None: ...

    @property
    def draft_architectures(self) -> Sequence[DraftArchitectureEntry]: ...

    @property
    def checkpoint_limits_context(self) -> bool: ...

    @property
    def core_fields(self) -> frozenset[str]:
        """Which of the method-specific core fields (METHOD_SPECIFIC_FIELDS) the method reads."""


class MethodCatalogue(Protocol):
    """The installed methods and their rules."""

    def method_names(self) -> list[str]:
        """Every installed method name (aliases excluded), sorted."""

    def resolve_method(self, requested: str, target: TargetInfo | None) -> MethodDescription:
        """The method ``requested`` names (itself, a registered alias, or a plugin's alias rule);
        raises :class:`~sonar_core.errors.ConfigError` on ``speculative_config.method`` when none."""

    def is_old_name(self, requested: str) -> bool:
        """Whether ``requested``, which resolves to another method name, is an old name of it
        (warned about) rather than a plain alias (accepted silently)."""

    def methods_for_draft_architecture(self, architecture: str) -> list[str]:
        """The installed methods that registered ``architecture`` as a draft architecture."""

    def methods_reading(self, field: str) -> list[str]:
        """The installed methods that declare they read the core field ``field``, sorted."""

    def default_num_speculative_tokens(self, config: SpeculativeConfig, target: TargetInfo | None) -> int | None:
        """The depth the method takes when the user sets none (from its checkpoint), or None."""

    def method_rules(
        self, config: SpeculativeConfig, target: TargetInfo | None, options: BaseModel | None = None
    ) -> list[str]:
        """Run the method's own rules; raise ConfigError (fields named bare) or return warnings.
        ``options`` is the method's validated options model (defaults filled), or None."""
