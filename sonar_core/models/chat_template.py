"""Chat templates rendered the way transformers renders them, without importing transformers.

A chat template is Jinja source that checkpoints ship; transformers defines how it is run: a
sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``, loop controls, a ``tojson``
filter that keeps non-ASCII text and HTML characters as they are, ``raise_exception`` and
``strftime_now`` globals, a ``{% generation %}`` block for its assistant masks, and a
``namespace`` that refuses underscore names. Its variables are the messages (with keys whose value
is None dropped), ``add_generation_prompt``, ``tools`` and ``documents`` (None here) and the
tokenizer's special tokens. This module reproduces that for plain conversations (dicts of strings),
which is what the engine renders; the tokenizer snapshot checks its output against transformers'
own before it is ever used in place of it.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Message fields transformers rewrites into one another before rendering (reasoning text under its
# older names): a conversation carrying them is not plain.
_REASONING_FIELDS = frozenset({"reasoning_content", "thinking", "reasoning"})


def is_plain_conversation(conversation: Any) -> bool:
    """Whether ``conversation`` is one non-empty list of messages whose keys are strings and whose
    values are strings or None: what :func:`render_chat_template` renders as transformers does."""
    if not isinstance(conversation, list) or not conversation:
        return False
    for message in conversation:
        if type(message) is not dict:
            return False
        for key, value in message.items():
            if type(key) is not str or key in _REASONING_FIELDS:
                return False
            if value is not None and type(value) is not str:
                return False
    return True


def render_chat_template(
    source: str,
    conversation: list[dict[str, str | None]],
    add_generation_prompt: bool,
    special_tokens: dict[str, Any],
) -> str:
    """The prompt text of a plain conversation (see :func:`is_plain_conversation`) through the
    template ``source``, with the tokenizer's ``special_tokens`` as variables."""
    messages = [
        {key: value for key, value in message.items() if value is not None} for message in conversation
    ]
    return _compile(source).render(
        **special_tokens,
        messages=messages,
        tools=None,
        documents=None,
        add_generation_prompt=add_generation_prompt,
    )


@lru_cache(maxsize=16)
def _compile(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationBlock, jinja2.ext.loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = _strftime_now
    environment.globals["dict"] = _TemplateDict()
    environment.globals["namespace"] = _TemplateNamespace
    return environment.from_string(source)


class _GenerationBlock(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks assistant text for transformers' masks;
    rendering keeps its body as it is."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """``dict(...)`` and ``dict.fromkeys(...)`` in a template, without the type itself (whose
    attributes would reach past the sandbox)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """Jinja's ``namespace`` refusing underscore-prefixed names, which could reach interpreter
    internals."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - Jinja's signature, so `namespace(self=...)` works
        self, args = args[0], args[1:]
        attributes = dict(*args, **kwargs)
        for name in attributes:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}"
            )
