"""Errors that reach the user: each one names what is wrong and how to fix it.

The command line prints these without a traceback (exit status 2 for configuration errors, 1 for
plugin errors), so their text must stand on its own.
"""

from __future__ import annotations

from collections.abc import Sequence


class SonarError(Exception):
    """Base class of every error Sonar raises on purpose."""


class ConfigError(SonarError, ValueError):
    """A configuration value is invalid.

    ``field`` is the dotted name the user wrote (``speculative_config.num_speculative_tokens``,
    ``max_model_len``), ``message`` what is wrong with it and ``fix`` what to change. ``detail`` is
    an optional preformatted block (a quoted value with a caret under the error) shown between the
    two. ``also`` holds further problems found in the same pass, so that the user fixes them all at
    once instead of one per run.

    It subclasses :class:`ValueError` so that raising it inside a pydantic validator keeps it as
    the cause of the validation error (see ``sonar_core.config.config_error_from_validation``), and
    so that callers used to catching ``ValueError`` for bad configuration keep working.
    """

    def __init__(
        self,
        field: str,
        message: str,
        fix: str,
        *,
        detail: str = "",
        also: Sequence[ConfigError] = (),
    ) -> None:
        self.field = field
        self.message = message
        self.fix = fix
        self.detail = detail
        self.also = tuple(also)
        super().__init__(self._render())

    def _render(self) -> str:
        text = f"{self.field}: {_sentence(self.message)}"
        text += f"\n\n{self.detail.rstrip()}\n\n" if self.detail else " "
        text += f"Fix: {_sentence(self.fix)}"
        return "\n\n".join([text, *(str(other) for other in self.also)])

    def __str__(self) -> str:
        return self._render()

    def __reduce__(self) -> tuple[object, ...]:
        # Keyword-only arguments (and subclasses' own signatures) defeat default exception pickling.
        return (_rebuild_config_error, (type(self), self.field, self.message, self.fix, self.detail, self.also))

    def with_field_prefix(self, prefix: str) -> ConfigError:
        """The same error with ``prefix.`` in front of the field, unless it is already there.

        Plugins name the fields of the speculative configuration bare (``prompt_lookup_min``);
        the user reads them as ``speculative_config.prompt_lookup_min``.
        """
        field = self.field
        if field != prefix and not field.startswith(prefix + "."):
            field = f"{prefix}.{field}"
        also = [error.with_field_prefix(prefix) for error in self.also]
        return _rebuild_config_error(type(self), field, self.message, self.fix, self.detail, also)


def _sentence(text: str) -> str:
    text = text.strip()
    return text if text.endswith((".", "!", "?")) else text + "."


def _rebuild_config_error(
    kind: type[ConfigError], field: str, message: str, fix: str, detail: str, also: Sequence[ConfigError]
) -> ConfigError:
    """An error of class ``kind`` (ConfigError or a subclass) with these parts, whatever the
    subclass's own constructor takes."""
    error = kind.__new__(kind)
    ConfigError.__init__(error, field, message, fix, detail=detail, also=also)
    return error


class PluginError(SonarError):
    """A plugin cannot be loaded or contradicts another plugin (a broken installation)."""


class DuplicateMethodError(PluginError):
    """Two registrations claim the same method name or alias."""

    def __init__(self, name: str, first: str, second: str) -> None:
        self.name = name
        self.first = first
        self.second = second
        super().__init__(
            f"speculation method name {name!r} is registered twice: by {first} and by {second}. "
            "Fix: uninstall one of the two distributions (pip uninstall ...), or load only one of them "
            "with SONAR_PLUGINS=<comma-separated entry-point names>."
        )

    def __reduce__(self) -> tuple[object, ...]:
        return (type(self), (self.name, self.first, self.second))
