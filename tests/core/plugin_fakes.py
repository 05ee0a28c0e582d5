"""Fake plugins for the core tests (a module of its own: test modules and conftest import it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel

from sonar_core.plugins import MethodSpec, PluginSource, hookimpl


class FakeMethodPlugin:
    """A plugin object that registers one method, optionally with aliases, options and a rule."""

    def __init__(
        self,
        name: str,
        aliases: tuple[str, ...] = (),
        old_names: tuple[str, ...] = (),
        options_model: type[BaseModel] | None = None,
        rule: Callable[[Any, Any], list[str] | None] | None = None,
        create: Callable[[Any, Any], Any] | None = None,
        default_depth: int | None = None,
        claims: tuple[str, ...] = (),
        draft_architectures: tuple[Any, ...] = (),
    ) -> None:
        self.name = name
        self.default_depth = default_depth
        self.claims = claims
        self.draft_architectures = draft_architectures
        self.aliases = aliases
        self.old_names = old_names
        self.options_model = options_model
        self.rule = rule
        self.create = create or (lambda context, weights: None)

    @hookimpl
    def sonar_register_methods(self, registry: Any) -> None:
        registry.register(
            MethodSpec(
                self.name,
                self.create,
                description=f"fake {self.name}",
                options_model=self.options_model,
                draft_architectures=self.draft_architectures,
            ),
            aliases=self.aliases,
            old_names=self.old_names,
        )

    @hookimpl
    def sonar_validate_speculative_config(self, config: Any, target: Any) -> list[str] | None:
        if config.method != self.name or self.rule is None:
            return None
        return self.rule(config, target)

    @hookimpl
    def sonar_default_num_speculative_tokens(self, config: Any, target: Any) -> int | None:
        return self.default_depth if config.method == self.name else None

    @hookimpl
    def sonar_claim_target_tensors(self, config: Any, target: Any) -> list[str] | None:
        return list(self.claims) if config is not None and config.method == self.name and self.claims else None


def fake_source(name: str, distribution: str | None = None, version: str = "1.0") -> PluginSource:
    return PluginSource(name, distribution or f"fake-{name}", version)
