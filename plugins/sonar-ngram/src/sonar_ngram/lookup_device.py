"""Prompt lookup for a whole batch on device tensors, with no host round trip inside the search.

Same rule as :mod:`sonar_core.spec_decode.prompt_lookup` (longest n in ``min_n..max_n``, most recent occurrence ending
before the last token, up to ``k`` following tokens); the drafts must be identical.

Shapes: the batch is a padded ``[B, W]`` token tensor whose row ``b`` is valid up to ``lengths[b]``
(cells beyond may hold anything, e.g. tokens of an earlier request in a reused slot). Each row is
left-padded with ``max_n - 1`` cells of -1, a value no token id takes, and unfolded into windows of
``max_n`` tokens ending at every position; growing n from 1 to ``max_n`` tightens a ``[B, W]`` mask of
match ends by one column comparison per n, so memory stays O(B * W) for any ``max_n``. The sentinel
makes windows that would start before the sequence fail on their own, and ends after
``lengths - 2`` are masked. There is no data-dependent control flow, so the function can be
captured by ``torch.compile`` or a CUDA graph.
"""

from __future__ import annotations

import torch

NO_TOKEN = -1


def batch_find_drafts(
    tokens: torch.Tensor,
    lengths: torch.Tensor,
    limits: torch.Tensor,
    min_n: int,
    max_n: int,
    k: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft for every row of ``tokens``.

    Args:
        tokens: ``[B, W]`` integer token ids (non-negative where valid).
        lengths: ``[B]`` number of valid tokens per row (``<= W``).
        limits: ``[B]`` most draft tokens a row may get (0 or less: no draft).
        min_n, max_n: inclusive range of n-gram lengths.
        k: width of the returned draft tensor (the largest ``limits`` value allowed).

    Returns:
        ``drafts`` ``[B, k]`` (entries past a row's count are 0), ``counts`` ``[B]`` (int64) and
        ``match_lengths`` ``[B]`` (int64): the length of the n-gram each row's drafts follow, 0 for
        a row without drafts.
    """
    batch, width = tokens.shape
    device = tokens.device
    lengths = lengths.to(torch.int64)
    padded = torch.cat([tokens.new_full((batch, max_n - 1), NO_TOKEN), tokens], dim=1)
    # windows[b, e, i] = tokens[b, e - (max_n - 1) + i]: the max_n tokens ending at position e.
    windows = padded.unfold(1, max_n, 1)
    # pattern[b, i] = tokens[b, lengths[b] - max_n + i]: the last max_n tokens of the row.
    pattern_index = (lengths - 1).clamp(min=0).unsqueeze(1) + torch.arange(max_n, device=device)
    pattern = padded.gather(1, pattern_index)

    positions = torch.arange(width, device=device)
    alive = positions.unsqueeze(0) <= (lengths - 2).unsqueeze(1)
    best_end = torch.full((batch,), -1, dtype=torch.int64, device=device)
    best_n = torch.zeros((batch,), dtype=torch.int64, device=device)
    for n in range(1, max_n + 1):
        # Compare the token n - 1 places before each end with the one n - 1 places before the last.
        column = max_n - n
        alive &= windows[:, :, column] == pattern[:, column].unsqueeze(1)
        if n >= min_n:
            # Most recent match of length >= n; a longer n overrides a shorter one.
            last = torch.where(alive, positions, -1).amax(dim=1)
            best_end = torch.where(last >= 0, last, best_end)
            best_n = torch.where(last >= 0, n, best_n)

    starts = best_end + 1
    # Overlapping copy (see sonar_core.spec_decode.prompt_lookup): the draft repeats with the match's distance from
    # the last token as its period, so every matched row drafts its full limit.
    period = (lengths - starts).clamp(min=1)
    counts = torch.where(best_end >= 0, limits.to(torch.int64), 0).clamp(min=0)
    offsets = torch.arange(k, device=device)
    gather_index = (starts.unsqueeze(1) + offsets % period.unsqueeze(1)).clamp(min=0, max=width - 1)
    drafts = tokens.gather(1, gather_index)
    drafts = torch.where(offsets.unsqueeze(0) < counts.unsqueeze(1), drafts, 0)
    return drafts, counts, torch.where(counts > 0, best_n, 0)


class DeviceTokenSlots:
    """Per-request token rows kept on the device, so each step uploads only the new tokens.

    Rows and row width grow by doubling (copying on the device); a request's row is reused by the
    next request once it is released.
    """

    def __init__(self, device: torch.device, max_len: int, rows: int = 8, width: int = 1024) -> None:
        self.device = device
        self.max_len = max_len
        self.tokens = torch.zeros((rows, max(1, min(width, max_len))), dtype=torch.int32, device=device)
        self._lengths: dict[str, int] = {}
        self._slots: dict[str, int] = {}
        self._free: list[int] = list(range(rows - 1, -1, -1))

    def slot(self, request_id: str) -> int:
        """The row of ``request_id``, assigning a free one (empty) on first use."""
        slot = self._slots.get(request_id)
        if slot is None:
            if not self._free:
                self._grow_rows()
            slot = self._free.pop()
            self._slots[request_id] = slot
            self._lengths[request_id] = 0
        return slot

    def release(self, request_id: str) -> None:
        """Forget ``request_id``; its row is free for another request."""
        slot = self._slots.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)
            del self._lengths[request_id]

    def length(self, request_id: str) -> int:
        """Tokens held for ``request_id`` (0 when unknown)."""
        return self._lengths.get(request_id, 0)

    def reserve(self, request_id: str, total: int) -> int:
        """Make room for ``total`` tokens in the request's row, record the length and return its slot."""
        slot = self.slot(request_id)
        if total > self.tokens.shape[1]:
            self._grow_width(total)
        self._lengths[request_id] = total
        return slot

    def write(self, flat_index: torch.Tensor, values: torch.Tensor) -> None:
        """Scatter ``values`` to ``flat_index`` (row * width + column), both already on the device."""
        self.tokens.view(-1).index_copy_(0, flat_index, values.to(self.tokens.dtype))

    def _grow_rows(self) -> None:
        rows, width = self.tokens.shape
        grown = torch.zeros((2 * rows, width), dtype=self.tokens.dtype, device=self.device)
        grown[:rows] = self.tokens
        self.tokens = grown
        self._free.extend(range(2 * rows - 1, rows - 1, -1))

    def _grow_width(self, needed: int) -> None:
        rows, width = self.tokens.shape
        new_width = max(needed, min(2 * width, self.max_len))
        grown = torch.zeros((rows, new_width), dtype=self.tokens.dtype, device=self.device)
        grown[:, :width] = self.tokens
        self.tokens = grown
