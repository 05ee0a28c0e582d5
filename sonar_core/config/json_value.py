"""Parse a JSON object given on the command line, with an error that shows where it broke.

The usual cause of a bad ``--speculative-config`` is the shell: without single quotes around the
whole object, Bash strips the double quotes of keys and strings (``{method: ngram}``) or splits the
value at spaces. The error quotes the text, puts a caret under the position where parsing stopped,
and gives the quoting advice of the user documentation.
"""

from __future__ import annotations

import json
from typing import Any

from sonar_core.errors import ConfigError

SHELL_QUOTING_ADVICE = (
    "put single quotes around the complete JSON object in Bash (--speculative-config "
    '\'{"method": "ngram", "num_speculative_tokens": 4}\'); JSON keys and string values keep their '
    "double quotes"
)

# Characters of a long line shown on each side of the error position.
_WINDOW = 60


class _DuplicateKeyError(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def parse_json_object(text: str, field: str = "speculative_config", *, note: str = "") -> dict[str, Any]:
    """``text`` as a dict; a :class:`ConfigError` naming ``field`` when it is not one JSON object.

    ``note`` is appended to the message (the command line uses it to say that the shell split the
    value into several arguments).
    """
    suffix = f" ({note})" if note else ""
    if not text.strip():
        raise ConfigError(field, f"the value is empty{suffix}", SHELL_QUOTING_ADVICE)
    try:
        value = json.loads(text, object_pairs_hook=_object_without_duplicate_keys)
    except json.JSONDecodeError as exc:
        raise ConfigError(
            field,
            f"the value is not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}{suffix}",
            SHELL_QUOTING_ADVICE if note or _looks_unquoted(text, exc.pos) else _syntax_fix(text, exc.pos),
            detail=point_at(text, exc.lineno, exc.colno),
        ) from None
    except _DuplicateKeyError as exc:
        raise ConfigError(
            field,
            f"the key {exc.key!r} appears more than once in the JSON object{suffix}",
            f"keep one {exc.key!r} entry",
        ) from None
    if not isinstance(value, dict):
        raise ConfigError(
            field,
            f"the value must be a JSON object ({{...}}), but it is a JSON {_json_kind(value)}{suffix}",
            SHELL_QUOTING_ADVICE,
            detail=point_at(text, 1, 1),
        )
    return value


def _looks_unquoted(text: str, position: int) -> bool:
    """Whether parsing stopped at a bare word (``{method: ngram}``): the shell ate the quotes."""
    return position < len(text) and (text[position].isalpha() or text[position] == "_")


def _syntax_fix(text: str, position: int) -> str:
    """The fix for a JSON mistake the shell did not cause: an object cut short, or a stray
    character (a trailing comma, a missing one)."""
    if not text[position:].strip():
        opened = text.count("{") - text.count("}")
        closing = f" ({opened} closing brace{'s' if opened > 1 else ''} missing)" if opened > 0 else ""
        return f"the object ends before it is complete{closing}: finish it, e.g. with a closing }}"
    return "fix the JSON at the caret: keys and string values in double quotes, entries separated by commas, no comma before }"


def point_at(text: str, lineno: int, colno: int) -> str:
    """The line ``lineno`` of ``text`` (1-based), indented, with a caret under column ``colno``."""
    lines = text.splitlines() or [""]
    line = lines[min(lineno, len(lines)) - 1].expandtabs(1)
    column = max(colno - 1, 0)
    start = max(0, column - _WINDOW)
    end = column + _WINDOW
    shown = ("..." if start else "") + line[start:end] + ("..." if end < len(line) else "")
    caret_at = column - start + (3 if start else 0)
    where = f"line {lineno}: " if len(lines) > 1 else ""
    return f"    {where}{shown}\n    {' ' * len(where)}{' ' * caret_at}^"


def _object_without_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for key, value in pairs:
        if key in result:
            raise _DuplicateKeyError(key)
        result[key] = value
    return result


def _json_kind(value: object) -> str:
    if isinstance(value, list):
        return "array"
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    return "number"
