"""Turn pydantic's ValidationError into a ConfigError that names the field and the fix.

Rules written as validators raise :class:`ConfigError` themselves; pydantic keeps that exception in
the error's context, and it is returned unchanged. Type errors (a string where a number belongs, an
unknown keyword) get a fix chosen by the error type.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from pydantic import ValidationError

from sonar_core.errors import ConfigError

_FIXES: Mapping[str, Callable[[Mapping[str, Any]], str]] = {
    "int_parsing": lambda ctx: "give a whole number",
    "int_type": lambda ctx: "give a whole number",
    "int_from_float": lambda ctx: "give a whole number without a fractional part",
    "float_parsing": lambda ctx: "give a number",
    "float_type": lambda ctx: "give a number",
    "bool_parsing": lambda ctx: "use true or false",
    "bool_type": lambda ctx: "use true or false",
    "string_type": lambda ctx: "give a string (in JSON, in double quotes)",
    "literal_error": lambda ctx: f"use one of {ctx.get('expected', 'the documented values')}",
    "greater_than": lambda ctx: f"use a value greater than {ctx.get('gt')}",
    "greater_than_equal": lambda ctx: f"use a value of at least {ctx.get('ge')}",
    "less_than": lambda ctx: f"use a value less than {ctx.get('lt')}",
    "less_than_equal": lambda ctx: f"use a value of at most {ctx.get('le')}",
    "missing": lambda ctx: "set it",
    "dict_type": lambda ctx: "give a JSON object (a dict in Python)",
    "model_type": lambda ctx: "give a JSON object (a dict in Python)",
    "model_attributes_type": lambda ctx: "give a JSON object (a dict in Python)",
}

_LONGEST_SHOWN_INPUT = 80


def config_error_from_validation(
    exc: ValidationError, prefix: str = "", known_fields: Iterable[str] = ()
) -> ConfigError:
    """One :class:`ConfigError` for every problem in ``exc`` (the first, with the rest in ``also``).

    ``prefix`` is put in front of field names (``speculative_config``); ``known_fields`` are the
    valid names, used to suggest the closest one for an unknown keyword.
    """
    known = list(known_fields)
    first, *rest = [_one_error(details, prefix, known) for details in exc.errors()]
    if not rest:
        return first
    return ConfigError(first.field, first.message, first.fix, detail=first.detail, also=rest)


def unknown_field_fix(name: str, known: Iterable[str], where: str) -> str:
    """The fix for an unknown key: the closest valid name when there is one, and the valid names."""
    names = sorted(set(known))
    close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]!r}? Otherwise, " if close else ""
    return f"{hint}remove {name!r}; {where} accepts: {', '.join(names)}"


def _one_error(details: Mapping[str, Any], prefix: str, known: list[str]) -> ConfigError:
    ctx = details.get("ctx") or {}
    original = ctx.get("error")
    if isinstance(original, ConfigError):
        return original.with_field_prefix(prefix) if prefix else original
    location = [str(part) for part in details.get("loc", ())]
    field = ".".join(([prefix] if prefix else []) + location) or prefix or "configuration"
    kind = details.get("type", "")
    if kind == "extra_forbidden":
        name = location[-1] if location else field
        return ConfigError(field, f"{name!r} is not a known field", unknown_field_fix(name, known, "it"))
    if kind in ("value_error", "assertion_error"):
        # A validator's own rule (a plugin's field_validator): its text is the message, said once.
        text = str(original) if original is not None else str(details.get("msg", "invalid value"))
        got = _short_repr(details.get("input"))
        message = text if got in text else f"{text} (got {got})"
        return ConfigError(field, message, f"give {location[-1] if location else field} a value that rule accepts")
    message = _lower_first(str(details.get("msg", "invalid value")))
    if kind != "missing":
        message += f", got {_short_repr(details.get('input'))}"
    fix = _FIXES.get(kind, lambda ctx: "see docs/configuration.md for the accepted values")(ctx)
    return ConfigError(field, message, fix)


def _lower_first(text: str) -> str:
    return text[:1].lower() + text[1:]


def _short_repr(value: object) -> str:
    text = repr(value)
    return text if len(text) <= _LONGEST_SHOWN_INPUT else text[: _LONGEST_SHOWN_INPUT - 3] + "..."
