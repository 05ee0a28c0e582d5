"""Attention for the long rows of a step (prefill chunks), one sequence at a time.

Padding a step's queries to its longest row (the batched layout of
:class:`~sonar_core.layers.attention.PagedAttention`) costs nothing when every row is alike, but a
prompt joining decoding requests pads each of them to the prompt's length: measured on SmolLM2
(bfloat16, 2 threads), 15 decodes plus a 250-token prompt took 918 ms in one padded step against
290 ms for the two parts alone. So a step with a row longer than the in-place kernel takes splits:
the short rows stay one batch, and each long row attends over its own context here, with no
padding; a fresh prompt (no earlier context) uses SDPA's causal flag instead of a mask, which lets
the kernel skip the upper triangle (2x at 2,048 tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sonar_core.kv import KVCache

# Queries per SDPA call of a long row with cached context (:meth:`LongRow.query_spans`).
SPAN_QUERIES = 128


@dataclass
class LongRow:
    """One sequence's tokens ``start : start + query_len`` of the flat batch, at the end of its
    ``seq_len`` positions, whose cache blocks are ``block_ids`` (in order)."""

    start: int
    query_len: int
    seq_len: int
    block_ids: torch.Tensor
    causal: bool = True
    _masks: dict[tuple[int | None, torch.dtype], torch.Tensor | None] = field(default_factory=dict, repr=False)

    def mask(self, window: int | None, dtype: torch.dtype) -> tuple[torch.Tensor | None, bool]:
        """``(additive [query_len, seq_len] mask or None, is_causal)`` for SDPA; built once per
        window and dtype (every layer of a step shares it)."""
        window_cuts = window is not None and window < self.seq_len
        if not window_cuts:
            if not self.causal:
                return None, False
            if self.seq_len == self.query_len:
                return None, True
        key = (window if window_cuts else None, dtype)
        if key not in self._masks:
            self._masks[key] = self._build_mask(window if window_cuts else None, dtype)
        return self._masks[key], False

    @property
    def cached_len(self) -> int:
        """Positions of the row's context cached before this step."""
        return self.seq_len - self.query_len

    def query_spans(self) -> list[tuple[int, int]]:
        """``(start, end)`` spans of a masked row's queries that attend as one SDPA call each, over
        the keys up to their last query only (causal rows: later keys are masked for them). A masked
        row scores every key for every query, so the upper triangle of its new tokens is wasted
        work: a third of it for 363 new tokens over 144 cached. Where the new tokens outnumber the
        cached ones, spans of SPAN_QUERIES cut most of that waste; where the cache is longer the
        extra calls cost more than they save. Measured on the embedded model's shape (9 query heads
        over 3 KV heads of 64, bfloat16, 2 threads, ms a layer, one call against spans of 128):
        144 cached + 363 new 1.42 -> 0.98, 144 + 313 1.31 -> 0.79, 208 + 237 0.91 -> 0.71; 1,024 +
        128 0.69 -> 0.72 and 1,024 + 512 3.23 -> 3.44 (kept whole)."""
        if not self.causal or self.query_len <= SPAN_QUERIES or self.query_len <= self.cached_len:
            return [(0, self.query_len)]
        return [(start, min(start + SPAN_QUERIES, self.query_len)) for start in range(0, self.query_len, SPAN_QUERIES)]

    def _build_mask(self, window: int | None, dtype: torch.dtype) -> torch.Tensor:
        device = self.block_ids.device
        query_pos = torch.arange(self.cached_len, self.seq_len, device=device)[:, None]
        key_pos = torch.arange(self.seq_len, device=device)[None, :]
        allowed = torch.ones(self.query_len, self.seq_len, dtype=torch.bool, device=device)
        if self.causal:
            allowed &= key_pos <= query_pos
        if window is not None:
            allowed &= key_pos > query_pos - window
        return torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))


def attend_long_row(
    q: torch.Tensor, kv_cache: KVCache, row: LongRow, scale: float, window: int | None
) -> torch.Tensor:
    """``q`` ``[query_len, heads, head_dim]`` over the row's context -> ``[query_len, heads * head_dim]``.
    Grouped-query heads are left to SDPA (``enable_gqa``), which reads each KV head once."""
    k_cache, v_cache = kv_cache
    kv_heads, head_dim = k_cache.shape[-2], k_cache.shape[-1]

    def context(cache: torch.Tensor) -> torch.Tensor:  # [1, kv_heads, seq_len, head_dim]
        return cache.index_select(0, row.block_ids).view(-1, kv_heads, head_dim)[: row.seq_len].transpose(0, 1)[None]

    mask, is_causal = row.mask(window, q.dtype)
    queries, keys, values = q.transpose(0, 1)[None], context(k_cache), context(v_cache)
    gqa = q.shape[1] != kv_heads
    # SDPA's causal flag (a fresh prompt, no mask) aligns the triangle at the first key: only a
    # masked row may be cut into spans.
    spans = row.query_spans() if mask is not None else [(0, row.query_len)]
    outs = []
    for start, end in spans:
        keys_end = row.cached_len + end
        outs.append(F.scaled_dot_product_attention(
            queries[:, :, start:end],
            keys[:, :, :keys_end],
            values[:, :, :keys_end],
            attn_mask=None if mask is None else mask[start:end, :keys_end],
            is_causal=is_causal,
            scale=scale,
            enable_gqa=gqa,
        ))
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=2)
    return out[0].transpose(0, 1).reshape(row.query_len, -1)
