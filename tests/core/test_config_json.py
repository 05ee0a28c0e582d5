"""JSON text of --speculative-config: errors quote the text, point at the position, and advise."""

from __future__ import annotations

import pytest

from sonar_core.config import SHELL_QUOTING_ADVICE, parse_json_object
from sonar_core.errors import ConfigError


def parse_error(text: str, **kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_json_object(text, "--speculative-config", **kwargs)
    return info.value


def test_valid_object():
    assert parse_json_object('{"method": "ngram", "num_speculative_tokens": 4}') == {
        "method": "ngram", "num_speculative_tokens": 4,
    }


def test_stripped_quotes_point_at_the_first_bare_key():
    error = parse_error("{method: ngram}")
    assert error.field == "--speculative-config"
    assert "line 1, column 2" in error.message
    assert error.detail == "    {method: ngram}\n     ^"
    assert error.fix == SHELL_QUOTING_ADVICE
    assert "single quotes" in str(error) and "double quotes" in str(error)


def test_multi_line_value_points_at_the_line():
    error = parse_error('{\n  "method": "ngram",\n  "num_speculative_tokens": 4,\n}')
    assert "line 4, column 1" in error.message
    assert error.detail.splitlines()[0] == "    line 4: }"
    assert error.detail.splitlines()[1] == "            ^"


def test_an_object_cut_short_is_not_blamed_on_the_shell():
    error = parse_error('{"method": "ngram", "num_speculative_tokens": 4')
    assert error.fix == "the object ends before it is complete (1 closing brace missing): finish it, e.g. with a closing }"
    trailing = parse_error('{"method": "ngram",}')
    assert "no comma before }" in trailing.fix and "single quotes" not in trailing.fix


def test_long_line_is_shown_around_the_error():
    text = '{"method": "ngram", "padding": "' + "x" * 200 + '", bad}'
    error = parse_error(text)
    shown, caret = error.detail.splitlines()
    assert len(shown) < 150 and shown.strip().startswith("...")
    assert shown[caret.index("^")] == "b"


@pytest.mark.parametrize(("text", "kind"), [('"ngram"', "string"), ("[1, 2]", "array"), ("4", "number")])
def test_value_must_be_an_object(text, kind):
    error = parse_error(text)
    assert f"it is a JSON {kind}" in error.message


def test_empty_value():
    assert "empty" in parse_error("  ").message


def test_duplicate_key():
    error = parse_error('{"method": "ngram", "method": "suffix"}')
    assert "'method' appears more than once" in error.message


def test_note_is_added_to_the_message():
    assert "(split)" in parse_error("{method:", note="split").message
