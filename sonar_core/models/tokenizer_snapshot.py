"""A tokenizer that serves the engine without importing transformers.

Importing transformers takes 0.6-0.8 s of an engine's start on a 2-core machine (its package
``__init__`` and its dependency checks), a fifth of the whole start of the embedded model. For a
fast tokenizer whose encoding and decoding are transformers' generic ones, what the engine asks of
a tokenizer (encode a prompt, decode tokens, render a plain conversation through the chat
template, the special token ids) is the Rust tokenizer of the ``tokenizers`` package, the special
tokens and the template. So when transformers has loaded a tokenizer, :func:`take_snapshot` keeps
those three, after checking that they answer a set of probes exactly as the tokenizer does, and
later starts build a :class:`SnapshotTokenizer` from them. Whatever else is asked of it (batch
calls, tensors, tools in a chat, any other attribute) is answered by the transformers tokenizer
itself, loaded on first need, so a snapshot never answers differently from the tokenizer it
stands for; it is only faster to start.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer

from sonar_core.models.chat_template import is_plain_conversation, render_chat_template

# Token ids a tokenizer exposes as attributes (None where it has no such token).
_ID_ATTRIBUTES = ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id")
# Transformers' methods a snapshot stands in for: a class that overrides any of them encodes,
# decodes or renders differently from the generic fast tokenizer, and is not snapshotted.
_GENERIC_METHODS = ("encode", "_encode_plus", "decode", "_decode", "apply_chat_template", "__len__")
# Those of them whose generic code makes ``decode`` the Rust tokenizer's decode.
_GENERIC_DECODE = ("decode", "_decode")
# Texts whose encodings, and conversations whose renderings, a snapshot must reproduce.
_PROBE_TEXTS = (
    "",
    "Hello, world!",
    "  leading spaces, trailing spaces  ",
    "don't stop . , ! ? ; : ( ) 'quotes' \"double\"",
    "def f(x):\n\treturn x  # tab and newline\n\n\nend",
    "naïve café, Größe, 東京, Привет, مرحبا, 🙂👍🏽",
    "1234567890 3.14159 -42 1e-9 0x1f",
)
_PROBE_CONVERSATIONS = (
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Name a colour."}],
    [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello, how can I help?"},
        {"role": "user", "content": "Tell me a fact about 東京 🙂"},
    ],
    [
        {"role": "user", "content": "  spaced  \n\nlines\t"},
        {"role": "assistant", "content": "ok", "name": None},
    ],
)


@dataclass(frozen=True)
class TokenizerSnapshot:
    """What a :class:`SnapshotTokenizer` needs, as JSON data plus the Rust tokenizer's file."""

    backend_file: Path  # the Rust tokenizer as transformers configured it (``to_str()``)
    split_special_tokens: bool
    special_tokens_map: dict[str, Any]
    token_ids: dict[str, int | None]
    chat_template: str | None
    length: int
    model_max_length: int

    def to_json(self) -> dict[str, Any]:
        """The entry kept in the cache (the Rust tokenizer's file is written beside it)."""
        return {
            "backend_file": self.backend_file.name,
            "split_special_tokens": self.split_special_tokens,
            "special_tokens_map": self.special_tokens_map,
            "token_ids": self.token_ids,
            "chat_template": self.chat_template,
            "length": self.length,
            "model_max_length": self.model_max_length,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], folder: Path) -> TokenizerSnapshot:
        return cls(**{**data, "backend_file": folder / data["backend_file"]})


class SnapshotTokenizer:
    """A transformers fast tokenizer's answers to the engine's calls, from a snapshot.

    The snapshot answers until something else is asked of the tokenizer (another method, another
    attribute, an assignment); that loads the transformers tokenizer (``load_full``, once), which
    answers every call from then on, the engine's included: a call the snapshot does not know may
    change the tokenizer (added tokens, a new template, padding settings), after which the snapshot
    would no longer describe it.
    """

    def __init__(self, snapshot: TokenizerSnapshot, name_or_path: str, load_full: Callable[[], Any]) -> None:
        backend = Tokenizer.from_file(str(snapshot.backend_file))
        backend.encode_special_tokens = snapshot.split_special_tokens
        served = {
            "backend_tokenizer": backend,
            "name_or_path": name_or_path,
            "chat_template": snapshot.chat_template,
            "model_max_length": snapshot.model_max_length,
            **snapshot.token_ids,
        }
        self.__dict__.update(_snapshot=snapshot, _load_full=load_full, _full=None, _served=served)

    @property
    def answers_from_snapshot(self) -> bool:
        """Whether the snapshot still answers (the transformers tokenizer has not been loaded)."""
        return self._full is None

    @property
    def full_tokenizer(self) -> Any:
        """The transformers tokenizer this snapshot stands for (imports transformers on first use);
        once loaded, it answers every call."""
        if self._full is None:
            self.__dict__["_full"] = self._load_full()
        return self._full

    @property
    def special_tokens_map(self) -> dict[str, Any]:
        if self.answers_from_snapshot:
            return dict(self._snapshot.special_tokens_map)
        return self._full.special_tokens_map

    def encode(self, text: Any, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        if kwargs or type(text) is not str or not self.answers_from_snapshot:
            return self.full_tokenizer.encode(text, add_special_tokens=add_special_tokens, **kwargs)
        return self._served["backend_tokenizer"].encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: Any, skip_special_tokens: bool = False, **kwargs: Any) -> Any:
        native = type(token_ids) is int or (
            type(token_ids) is list and all(type(token) is int for token in token_ids)
        )
        if kwargs or not native or not self.answers_from_snapshot:
            return self.full_tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens, **kwargs)
        ids = [token_ids] if type(token_ids) is int else token_ids
        return self._served["backend_tokenizer"].decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        conversation: Any,
        *args: Any,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        **kwargs: Any,
    ) -> Any:
        template = self._snapshot.chat_template
        native = not (args or kwargs or tokenize) and template is not None and is_plain_conversation(conversation)
        if not native or not self.answers_from_snapshot:
            return self.full_tokenizer.apply_chat_template(
                conversation, *args, tokenize=tokenize, add_generation_prompt=add_generation_prompt, **kwargs
            )
        return render_chat_template(template, conversation, add_generation_prompt, self._snapshot.special_tokens_map)

    def __len__(self) -> int:
        return self._snapshot.length if self.answers_from_snapshot else len(self._full)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.full_tokenizer(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name in ("_snapshot", "_load_full", "_full", "_served"):
            raise AttributeError(name)
        if self.answers_from_snapshot and name in self._served:
            return self._served[name]
        return getattr(self.full_tokenizer, name)

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self.full_tokenizer, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self.full_tokenizer, name)

    def __reduce__(self) -> tuple[Any, ...]:
        if not self.answers_from_snapshot:  # the tokenizer may have changed: send it as it is
            return (_identity, (self._full,))
        return (SnapshotTokenizer, (self._snapshot, self._served["name_or_path"], self._load_full))

    def __repr__(self) -> str:
        return f"SnapshotTokenizer(name_or_path={self._served['name_or_path']!r}, vocab_size={len(self)})"


def _identity(value: Any) -> Any:
    return value


def take_snapshot(
    tokenizer: Any, backend_file: Path, name_or_path: str, load_full: Callable[[], Any]
) -> TokenizerSnapshot | None:
    """A snapshot of a loaded transformers ``tokenizer`` whose Rust tokenizer is written to
    ``backend_file``, when the snapshot answers every probe exactly as ``tokenizer`` does; None for
    a tokenizer whose class encodes, decodes or renders in its own way."""
    if not _is_generic(tokenizer, _GENERIC_METHODS) or _cleans_up_spaces(tokenizer):
        return None
    if not isinstance(tokenizer.split_special_tokens, bool):
        return None
    try:
        template = tokenizer.get_chat_template()
    except ValueError:  # no template, or several with no default: transformers' errors apply
        template = None
    tokenizer.encode("")  # settles the Rust tokenizer's truncation and padding as encoding leaves them
    backend_file.parent.mkdir(parents=True, exist_ok=True)
    backend_file.write_text(tokenizer.backend_tokenizer.to_str(), encoding="utf-8")
    snapshot = TokenizerSnapshot(
        backend_file=backend_file,
        split_special_tokens=tokenizer.split_special_tokens,
        special_tokens_map=dict(tokenizer.special_tokens_map),
        token_ids={name: getattr(tokenizer, name) for name in _ID_ATTRIBUTES},
        chat_template=template if isinstance(template, str) else None,
        length=len(tokenizer),
        model_max_length=int(tokenizer.model_max_length),
    )
    if not answers_like(SnapshotTokenizer(snapshot, name_or_path, load_full), tokenizer):
        backend_file.unlink(missing_ok=True)
        return None
    return snapshot


def answers_like(snapshot: SnapshotTokenizer, tokenizer: Any) -> bool:
    """Whether ``snapshot`` answers the probes (encodings with and without special tokens, decodes
    of those and of single tokens across the vocabulary, chat renderings) as ``tokenizer`` does."""
    texts = [*_PROBE_TEXTS, *(str(token) for token in snapshot.special_tokens_map.values())]
    texts.append(
        "".join(f"{token} x" for token in snapshot.special_tokens_map.values() if isinstance(token, str))
    )
    for text in texts:
        for special in (True, False):
            ids = _outcome(tokenizer.encode, text, add_special_tokens=special)
            if ids != _outcome(snapshot.encode, text, add_special_tokens=special):
                return False
            if isinstance(ids, list) and not _decodes_alike(snapshot, tokenizer, ids):
                return False
    step = max(1, len(tokenizer) // 257)
    if not all(_decodes_alike(snapshot, tokenizer, [token]) for token in range(0, len(tokenizer), step)):
        return False
    if any(getattr(snapshot, name) != getattr(tokenizer, name) for name in _ID_ATTRIBUTES):
        return False
    if snapshot.chat_template is None:
        return True
    return all(
        _outcome(snapshot.apply_chat_template, conversation, tokenize=False, add_generation_prompt=prompt)
        == _outcome(tokenizer.apply_chat_template, conversation, tokenize=False, add_generation_prompt=prompt)
        for conversation in _PROBE_CONVERSATIONS
        for prompt in (True, False)
    )


def _decodes_alike(snapshot: SnapshotTokenizer, tokenizer: Any, ids: list[int]) -> bool:
    return all(
        _outcome(snapshot.decode, ids, skip_special_tokens=skip)
        == _outcome(tokenizer.decode, ids, skip_special_tokens=skip)
        for skip in (True, False)
    )


def _outcome(call: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """The call's result, or its error's type and message (so that two calls that fail alike
    compare equal)."""
    try:
        return call(*args, **kwargs)
    except Exception as exc:
        return (type(exc).__name__, str(exc))


def rust_decoder(tokenizer: Any) -> Any | None:
    """The Rust tokenizer whose ``decode(ids, skip_special_tokens=...)`` is exactly
    ``tokenizer.decode(ids, skip_special_tokens=...)``, for callers that decode often (transformers'
    wrapper costs 4-5 times the Rust call on a short window): a snapshot's while it answers, a
    transformers fast tokenizer's when its decoding is the generic one and cleans up no spaces;
    None for any other tokenizer."""
    if isinstance(tokenizer, SnapshotTokenizer):
        if tokenizer.answers_from_snapshot:
            return tokenizer.backend_tokenizer
        tokenizer = tokenizer.full_tokenizer
    if not _is_generic(tokenizer, _GENERIC_DECODE) or _cleans_up_spaces(tokenizer):
        return None
    return tokenizer.backend_tokenizer


def _is_generic(tokenizer: Any, methods: tuple[str, ...]) -> bool:
    """Whether ``tokenizer`` is a transformers fast tokenizer that keeps the generic ``methods``.
    Without transformers imported, nothing can be one (and nothing imports it for the check)."""
    if "transformers" not in sys.modules:
        return False
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    kind = type(tokenizer)
    return isinstance(tokenizer, TokenizersBackend) and all(
        getattr(kind, name) is getattr(TokenizersBackend, name) for name in methods
    )


def _cleans_up_spaces(tokenizer: Any) -> bool:
    """Whether ``tokenizer`` is set to clean up spaces before punctuation after the Rust decode.
    (Transformers skips that clean-up for BPE models unless forced, but a tokenizer set to it is
    taken as cleaning up: only those that plainly do not are decoded through Rust alone.)"""
    return bool(getattr(tokenizer, "clean_up_tokenization_spaces", True))
