"""Incremental detokenization that never emits half of a multi-byte character."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sonar_core.models.tokenizer_snapshot import rust_decoder

# Decoding a token sequence that ends inside a UTF-8 character yields this replacement character.
_INCOMPLETE = "\ufffd"
# The prompt's last tokens that start the first window (their text is context, never emitted).
_PROMPT_CONTEXT = 6
# A window that holds more tokens than this after an emission restarts at the emitted tokens. A
# decode costs a fixed part and a part per token (about 0.2 and 0.1 us with the Rust tokenizer,
# 1.5 and 0.2 us through transformers' wrapper), so a window longer than a few tokens costs more
# than the extra decode of a restart saves.
_MAX_WINDOW = 4


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, one append at a time.

    Decoding a token on its own loses the leading space of SentencePiece/byte-level pieces and splits
    multi-byte characters, so each append decodes a short window of the latest tokens and emits the
    part that extends the text of the window's tokens before the new ones. Text is held back while
    it ends with an incomplete character.

    The emitted text is that of the classic two-decode scheme (vLLM's): a window from
    ``prefix_offset``, which moves to ``read_offset`` after each emission, decoded with and without
    the new tokens. Here most appends decode once: the window keeps its start across emissions
    (until it holds more than ``_MAX_WINDOW`` tokens, then it restarts at the tokens just emitted,
    whose text the next append decodes too) so that the text without the new tokens is the
    previous append's text, remembered: about 1.25 decodes per token instead of 2. For complete
    text that is the same text, since a decoder joins the pieces of whole characters the same way
    wherever the window starts. A window whose text holds a replacement character other than at
    its end (bytes that are not valid UTF-8) may decode it otherwise; that append decodes the
    two-decode scheme's windows instead, and the window restarts there.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self._decode = _decode_function(tokenizer, skip_special_tokens)
        # The window's tokens. Those before _read_offset are emitted (or prompt) and decode to
        # _prefix_text (None until decoded); _prefix_offset is where the two-decode scheme's window
        # starts in it (0: the windows are the same).
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None
        self.text = ""

    def append(self, token_ids: list[int]) -> str:
        """Add tokens; return the newly completed text (possibly empty)."""
        ids = self._ids
        ids.extend(token_ids)
        if self._prefix_text is None:
            self._prefix_text = self._decode(ids[: self._read_offset])
        full_text = self._decode(ids)
        clean = _INCOMPLETE not in full_text.rstrip(_INCOMPLETE)
        if not clean and self._prefix_offset:
            # Replacement characters: decode the two-decode scheme's windows, and keep to them.
            del ids[: self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
            self._prefix_text = self._decode(ids[: self._read_offset])
            full_text = self._decode(ids)
        prefix_text = self._prefix_text
        if full_text.endswith(_INCOMPLETE) or len(full_text) <= len(prefix_text):
            return ""
        new_text = full_text[len(prefix_text) :]
        self.text += new_text
        if clean and _INCOMPLETE not in prefix_text and len(ids) <= _MAX_WINDOW:
            # The two-decode scheme's window moves on to where this one's new text starts (never
            # inside a character: the prompt may end inside one); this one keeps its start and text.
            self._prefix_offset = self._read_offset
            self._prefix_text = full_text
        else:
            # Restart at the two-decode scheme's next window: the tokens just emitted.
            del ids[: self._read_offset]
            self._prefix_offset = 0
            self._prefix_text = None
        self._read_offset = len(ids)
        return new_text


def _decode_function(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``tokenizer.decode(ids, skip_special_tokens=...)``, through the Rust tokenizer directly where
    that is the same call (:func:`~sonar_core.models.tokenizer_snapshot.rust_decoder`)."""
    backend = rust_decoder(tokenizer)
    decode = backend.decode if backend is not None else tokenizer.decode

    def call(ids: list[int]) -> str:
        return decode(ids, skip_special_tokens=skip_special_tokens)

    return call
