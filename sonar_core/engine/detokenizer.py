"""Incremental detokenization that never emits half of a multi-byte character."""

from __future__ import annotations

from typing import Any

# Decoding a token sequence that ends inside a UTF-8 character yields this replacement character.
_INCOMPLETE = "\ufffd"


class IncrementalDetokenizer:
    """Turns a growing list of output token ids into text, one append at a time.

    Decoding a token on its own loses the leading space of SentencePiece/byte-level pieces and splits
    multi-byte characters, so each step decodes a short window (``prefix_offset`` .. end) and emits
    the part that extends the window's earlier decoding. Text is held back while it ends with an
    incomplete character.
    """

    def __init__(self, tokenizer: Any, prompt_token_ids: list[int], skip_special_tokens: bool = True):
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(prompt_token_ids[-6:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self.text = ""

    def append(self, token_ids: list[int]) -> str:
        """Add tokens; return the newly completed text (possibly empty)."""
        self._ids.extend(token_ids)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        full_text = self._decode(self._ids[self._prefix_offset :])
        if full_text.endswith(_INCOMPLETE) or len(full_text) <= len(prefix_text):
            return ""
        new_text = full_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        self.text += new_text
        return new_text

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special)
