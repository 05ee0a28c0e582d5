"""Prompt lookup on the host: find the last n tokens earlier in the sequence and copy what followed.

The ``ngram`` method drafts with it alone; a learned method can put it in front of its head
(:mod:`sonar_core.spec_decode.lookup_first`). Rule (shared with ``sonar_ngram.lookup_device``,
which must give identical drafts):

- the pattern is the last ``n`` tokens; ``n`` runs from ``max_n`` down to ``min_n`` and the first
  (longest) ``n`` with an earlier occurrence wins;
- an occurrence is any earlier window equal to the pattern that ends before the last token, so it
  may overlap the pattern itself; of several, the most recent (rightmost) one is used;
- the draft is the ``k`` tokens that follow the occurrence. Where they run past the end of the
  sequence, copying continues from the draft itself (an overlapping copy, as in LZ77): the
  occurrence ends ``p`` tokens before the last token, so the draft repeats with period ``p``.
  This is exactly what applying the lookup again after each drafted token would propose, and it
  drafts the full ``k`` tokens in a repeating loop instead of one period.

The search is vectorised over match *end* positions: one comparison of the whole sequence with the
last token gives every end of a 1-token match; each further step keeps the ends whose match also
extends one token further back. The candidate set only shrinks, so the common case (few repeats)
costs one O(L) numpy pass plus a few tiny ones, and a fully repetitive sequence costs O(L * max_n).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from sonar_core.errors import ConfigError

TOKEN_DTYPE = np.int32
# Both bounds when neither prompt_lookup_min nor prompt_lookup_max is set (vLLM's default).
DEFAULT_PROMPT_LOOKUP = 5

_EMPTY = np.empty(0, dtype=TOKEN_DTYPE)


def find_match_end(tokens: np.ndarray, min_n: int, max_n: int) -> tuple[int, int]:
    """Return ``(end, n)``: the index of the last token of the chosen occurrence and its length.

    ``(-1, 0)`` when no n-gram of length ``min_n..max_n`` recurs.
    """
    length = tokens.shape[0]
    # An occurrence must end at index length - 2 or earlier and start at index 0 or later.
    max_n = min(max_n, length - 1)
    if max_n < min_n:
        return -1, 0
    ends = np.flatnonzero(tokens[: length - 1] == tokens[length - 1])
    n = 1
    while ends.size and n < max_n:
        # Extend every surviving match one token to the left; ends < n have nothing there.
        extendable = ends[np.searchsorted(ends, n) :]
        longer = extendable[tokens[extendable - n] == tokens[length - 1 - n]]
        if not longer.size:
            break
        ends = longer
        n += 1
    if not ends.size or n < min_n:
        return -1, 0
    return int(ends[-1]), n


def find_draft(tokens: np.ndarray, min_n: int, max_n: int, k: int) -> tuple[np.ndarray, int]:
    """Draft up to ``k`` tokens for ``tokens`` (1-D integer array) and the matched n-gram's length;
    an empty array and 0 when none match (or ``k`` is 0: then nothing is searched)."""
    if k <= 0:
        return _EMPTY, 0
    end, n = find_match_end(tokens, min_n, max_n)
    return draft_after(tokens, end, k), n


def draft_after(tokens: np.ndarray, end: int, k: int) -> np.ndarray:
    """The ``k`` tokens that follow the occurrence ending at ``end`` (:func:`find_match_end`'s),
    copied on from the draft itself past the sequence's end; empty for no occurrence (``end < 0``)."""
    if end < 0 or k <= 0:
        return _EMPTY
    period = tokens.shape[0] - 1 - end
    return tokens[end + 1 + np.arange(k) % period]


class TokenHistory:
    """One request's tokens as a growing numpy array, so a step converts only its new tokens.

    Capacity doubles when full, so appending is amortised O(1) per token and the array handed to
    :func:`find_draft` is a view, never a fresh conversion of the whole list.
    """

    def __init__(self, capacity: int = 256) -> None:
        self._buffer = np.empty(max(capacity, 1), dtype=TOKEN_DTYPE)
        self.length = 0

    def sync(self, token_ids: Sequence[int], num_new_tokens: int) -> None:
        """Bring the buffer up to ``token_ids``, of which the last ``num_new_tokens`` are new.

        Tokens before ``len(token_ids) - num_new_tokens`` were seen by an earlier call (the engine
        never rewrites accepted tokens), so only the tail is converted. When the buffer holds fewer
        tokens than that (a fresh or re-added request), the missing part is written too.
        """
        total = len(token_ids)
        start = max(0, min(self.length, total - num_new_tokens))
        if total > self._buffer.shape[0]:
            grown = np.empty(max(total, 2 * self._buffer.shape[0]), dtype=TOKEN_DTYPE)
            grown[:start] = self._buffer[:start]
            self._buffer = grown
        self._buffer[start:total] = token_ids[start:]
        self.length = total

    def view(self) -> np.ndarray:
        """The tokens held, without copying."""
        return self._buffer[: self.length]


@dataclass(frozen=True)
class LookupBounds:
    """Inclusive range of n-gram lengths to match; the longest length that matches wins."""

    min_n: int
    max_n: int


def resolve_lookup_bounds(prompt_lookup_min: int | None, prompt_lookup_max: int | None) -> LookupBounds:
    """The bounds of ``prompt_lookup_min`` / ``prompt_lookup_max`` with vLLM's rule for unset ones,
    so configs carry over: neither set, both are 5; one set, the other takes its value (a single
    n-gram length); both set, as given. Range checks are :func:`lookup_bound_errors`'."""
    if prompt_lookup_min is None and prompt_lookup_max is None:
        return LookupBounds(DEFAULT_PROMPT_LOOKUP, DEFAULT_PROMPT_LOOKUP)
    if prompt_lookup_min is None:
        return LookupBounds(prompt_lookup_max, prompt_lookup_max)
    if prompt_lookup_max is None:
        return LookupBounds(prompt_lookup_min, prompt_lookup_min)
    return LookupBounds(prompt_lookup_min, prompt_lookup_max)


def lookup_bound_errors(prompt_lookup_min: int | None, prompt_lookup_max: int | None, method: str) -> list[ConfigError]:
    """The bound rules of any method that looks up its prompt: each set bound at least 1, and the
    minimum not above the maximum once the defaults are applied."""
    errors = [
        ConfigError(field, f"{field}={value} is not a valid n-gram length for method {method!r}", f"set {field} to 1 or more")
        for field, value in (("prompt_lookup_min", prompt_lookup_min), ("prompt_lookup_max", prompt_lookup_max))
        if value is not None and value < 1
    ]
    bounds = resolve_lookup_bounds(prompt_lookup_min, prompt_lookup_max)
    if not errors and bounds.min_n > bounds.max_n:
        errors.append(
            ConfigError(
                "prompt_lookup_min",
                f"prompt_lookup_min={bounds.min_n} is greater than prompt_lookup_max={bounds.max_n}",
                f"set prompt_lookup_min to at most {bounds.max_n}, or raise prompt_lookup_max",
            )
        )
    return errors


class LookupDraft(NamedTuple):
    """A request's drafts and the length of the n-gram they were copied after (0: no match)."""

    tokens: list[int]
    match_length: int


class PromptLookup:
    """Prompt lookup for many requests: one :class:`TokenHistory` per request, brought up to date
    with each step's new tokens, and the draft of its bounds. The ``ngram`` proposer is this alone;
    :class:`~sonar_core.spec_decode.lookup_first.LookupFirstProposer` puts it in front of a head."""

    def __init__(self, bounds: LookupBounds) -> None:
        self.bounds = bounds
        self._histories: dict[str, TokenHistory] = {}

    def add(self, request_id: str, prompt_token_ids: Sequence[int]) -> None:
        """Start an empty buffer sized for the prompt; the first draft call fills it."""
        self._histories[request_id] = TokenHistory(capacity=2 * len(prompt_token_ids))

    def remove(self, request_id: str) -> None:
        self._histories.pop(request_id, None)

    def draft(self, request_id: str, token_ids: Sequence[int], num_new_tokens: int, max_tokens: int) -> LookupDraft:
        """Up to ``max_tokens`` drafts for the request whose tokens are ``token_ids`` (the last
        ``num_new_tokens`` new since the previous call); no tokens when nothing matches."""
        history = self._histories.get(request_id)
        if history is None:  # add() was skipped
            history = self._histories[request_id] = TokenHistory(capacity=2 * len(token_ids))
        history.sync(token_ids, num_new_tokens)
        drafts, match_length = find_draft(history.view(), self.bounds.min_n, self.bounds.max_n, max_tokens)
        return LookupDraft(drafts.tolist(), match_length)
