"""Attention over a paged KV cache, in pure PyTorch (CPU and CUDA).

Cache layout, per attention layer: ``(k_cache, v_cache)``, each
``[num_blocks, block_size, num_kv_heads, head_dim]``. A sequence's token at position ``p`` lives in
block ``block_table[p // block_size]`` at offset ``p % block_size``; its flat slot is
``block * block_size + offset``.

One engine step is one flattened batch of ``T`` new tokens from ``B`` sequences (prefill chunks and
decode tokens mixed). Everything that depends only on the batch shape (which cache blocks to read,
where each query sits in a padded ``[B, max_query_len]`` layout, the boolean mask) is computed once
per step in :meth:`AttentionMetadata.build` and reused by every layer, so a layer costs: two
``index_copy_`` (cache write), two ``index_select`` of whole blocks (context read), one
``scaled_dot_product_attention``. On the CPU, Sonar's kernels (:mod:`sonar_core.cpu_kernels`)
write the cache in one pass and attend decode steps in place, reading each sequence's blocks where
they lie (see :func:`attends_in_place`).

Grouped-query attention is done without repeating K/V: the query heads that share a KV head are
folded into the query-length axis (``[B, kv_heads, n_rep * max_query_len, head_dim]``), so one KV
head serves its whole group in a single batched matmul.

Sliding-window layers (``PagedAttention(..., sliding_window=W)``) see only the keys of the last
``W`` positions up to and including the query's own (key position ``> query position - W``), as
transformers' ``sliding_window`` defines it. The window is one more mask term, built once per step
and window size (:meth:`AttentionMetadata.window_mask`); layers without a window never build it.
The cache keeps every position of a windowed layer: older keys are masked, not evicted.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sonar_core import cpu_kernels
from sonar_core.cpu_features import cpu_flags
from sonar_core.kv import KVCache, StateBatch
from sonar_core.layers.long_rows import LongRow, attend_long_row

# Sonar's CPU kernel attends in place for decode steps (one query per sequence), and, where that
# is faster for several queries too (AVX-512 builds share each key among a sequence's queries, AVX2
# builds beat the gathered SDPA query by query), for longer rows as :func:`in_place_policy` says.
# Other rows (prefill chunks) gather their context and let PyTorch's SDPA run its blocked matmuls.
#
# Where the gathered path has no AMX tiles, kernels that share keys stay ahead at every row length
# measured, so there every step attends in place, prompts included. On an AMD EPYC with AVX-512
# BF16 (2 threads): steps of 9 / 12 / 16 rows over 2,048 cached tokens 55.5 / 58.4 / 71.6 ms
# gathered against 26.9 / 33.0 / 38.3 in place (bfloat16); whole prefills 11-23% faster in place
# at 32-2,048 tokens (float32 3-9%), 1.58x at 8,000 (docs/performance.md, "First tokens on
# Sonar's kernels"). AVX2 builds keep eight: their query-by-query path was not measured past it.
#
# With AMX, SDPA multiplies bfloat16 on tiles, and so does Sonar's kernel where the cache's blocks
# hold whole tiles of keys (:func:`sonar_core.cpu_kernels.attention_tile_keys`: 16; the default
# block size is 16): it scores 16 keys against up to 16 query rows, and sums 32 keys' values of
# them, per tile multiply-add. Then every step attends in place. On a Xeon with AMX (SmolLM2, 2
# threads, a whole step, gathered past eight queries against in place, median ms;
# docs/performance.md, "Attention on AMX tiles"), cached + new tokens: 1 + 400 174.4 against
# 153.2, 144 + 363 166.8 / 147.9, 512 + 160 76.1 / 68.7, 2,048 + 64 61.9 / 58.5, 1 + 2,048
# 1,077.7 / 1,062.8, level at 1 + 640, 1 + 1,024 and 1,024 + 128; gathered ahead only for chunks
# of hundreds of tokens over a long cache: 1,024 + 512 292.9 / 302.2, 2,048 + 256 181.2 / 194.6.
# With blocks of other sizes the kernel scores keys with vector instructions, and a row of many
# queries over many keys is faster gathered: the longest row's causal scores
# (:meth:`AttentionMetadata.longest_row_scores`) separated the two, in place winning up to about
# 33k of them and gathered from about 35k, so such steps attend in place up to
# AMX_BF16_IN_PLACE_MAX_SCORES. In float32 the same Xeon's SDPA has no tiles and in place won
# everywhere measured (1.01-1.15x, up to 1,024-token prompts).
#
# A step that does not attend in place and has a row of more than BATCHED_MAX_QUERIES queries
# splits (:meth:`AttentionMetadata.split`): rows of up to that many queries attend as one padded
# batch, each longer one alone (:mod:`sonar_core.layers.long_rows`).
BATCHED_MAX_QUERIES = 8
AMX_BF16_IN_PLACE_MAX_SCORES = 32_768


@dataclass(frozen=True)
class InPlacePolicy:
    """Which steps attend in place: every step whose cache blocks hold whole tiles of ``tile_keys``
    keys (when set); else those whose rows have at most ``max_queries`` queries each, and longer
    ones while their longest row scores at most ``max_scores`` query-key pairs."""

    max_queries: int
    max_scores: int = 0
    tile_keys: int = 0

    def takes(self, metadata: AttentionMetadata) -> bool:
        if self.tile_keys and metadata.block_size % self.tile_keys == 0:
            return True
        return metadata.max_query_len <= self.max_queries or metadata.longest_row_scores() <= self.max_scores


def in_place_policy_for(
    flags: frozenset[str], shares_keys: bool, dtype: torch.dtype, tile_keys: int = 0
) -> InPlacePolicy:
    """The steps that attend in place on a CPU with these flags, for kernels that verify in place;
    ``shares_keys``: they score each key once for all of a sequence's queries (AVX-512 builds);
    ``tile_keys``: they score bfloat16 keys on AMX tiles of that many (0: not)."""
    if not shares_keys:
        return InPlacePolicy(BATCHED_MAX_QUERIES)
    if "amx_bf16" in flags and dtype == torch.bfloat16:
        return InPlacePolicy(BATCHED_MAX_QUERIES, AMX_BF16_IN_PLACE_MAX_SCORES, tile_keys)
    return InPlacePolicy(sys.maxsize)


@functools.cache
def in_place_policy(dtype: torch.dtype) -> InPlacePolicy:
    """The steps that attend in place in this process: the rule above for the loaded kernels' build
    on this CPU (a build for another instruction set, ``SONAR_CPU_KERNELS_ARCH``, gets its own
    path's), decode steps only where the kernels attend nothing else in place."""
    if not cpu_kernels.attention_verifies_in_place():
        return InPlacePolicy(1)
    return in_place_policy_for(
        cpu_flags(), cpu_kernels.attention_shares_keys(), dtype, cpu_kernels.attention_tile_keys()
    )


def attends_in_place(metadata: AttentionMetadata, dtype: torch.dtype) -> bool:
    """Whether a step's attention in ``dtype`` runs on the in-place kernel (see above)."""
    return in_place_policy(dtype).takes(metadata)


@dataclass
class AttentionMetadata:
    """One flattened batch: B sequences, T new tokens in total, sequence i owning tokens
    ``query_start_loc[i]:query_start_loc[i+1]`` of the flat batch.

    Build it with :meth:`build`. Constructing it directly from the five tensors also works (the
    derived fields are then computed from them, which reads them back to the host once).
    """

    query_start_loc: torch.Tensor  # [B+1] int64
    seq_lens: torch.Tensor  # [B] int64: context length of seq i INCLUDING this step's new tokens
    block_tables: torch.Tensor  # [B, max_blocks] int64 (padded with 0)
    slot_mapping: torch.Tensor  # [T] int64: flat cache slot of each new token
    positions: torch.Tensor  # [T] int64: position of each new token (= seq_len - query_len + j)
    block_size: int
    # False: the new tokens of a sequence also attend to all new tokens of the same sequence
    # (non-causal block drafting). Earlier context is always visible.
    causal: bool = True
    # The rows' recurrent-state slots, for models with linear-attention layers (None otherwise);
    # the model runner sets it after build().
    state: StateBatch | None = None

    # ---- derived once per step, shared by all layers ------------------------------------------
    num_seqs: int = 0
    max_query_len: int = 0
    max_seq_len: int = 0
    # [B * nb] block ids to read, nb = ceil(max_seq_len / block_size): row b's blocks, in order, so
    # the gathered context of row b has token position p at index p.
    context_block_ids: torch.Tensor | None = None
    # [T] index of each new token in the padded [B * max_query_len] query layout; None when the flat
    # batch already is that layout (all query lengths equal, e.g. pure decode or one sequence).
    query_pad_index: torch.Tensor | None = None
    # Whether some query may not see every key of its row, so that :attr:`attn_mask` is not None.
    # The mask itself is built on first read: Sonar's CPU kernels attend causally from the lengths
    # and never read it, so a step they run does not pay for building it.
    needs_mask: bool = False
    _attn_mask: torch.Tensor | None = field(default=None, init=False, repr=False)
    _grouped_masks: dict[int, torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    _window_masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict, init=False, repr=False)
    # The host lists the derived fields came from, (query_lens, seq_lens); see host_lens().
    _host_lens: tuple[list[int], list[int]] | None = field(default=None, init=False, repr=False)
    _split: StepSplit | None = field(default=None, init=False, repr=False)
    _longest_row_scores: int | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.num_seqs == 0:  # constructed directly, not through build()
            self._derive(*self.host_lens(), self.query_start_loc.device)

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device,
        causal: bool = True,
    ) -> AttentionMetadata:
        """Metadata of one step from host-side lists (one entry per sequence).

        ``seq_lens[i]`` counts the new tokens too; ``block_tables[i]`` must cover ``seq_lens[i]``
        positions. Raises ValueError on inconsistent input.
        """
        num_seqs = len(query_lens)
        if not (num_seqs == len(seq_lens) == len(block_tables)) or num_seqs == 0:
            raise ValueError(
                "query_lens, seq_lens and block_tables must be non-empty and of equal length, got "
                f"{len(query_lens)}, {len(seq_lens)}, {len(block_tables)}"
            )
        positions: list[int] = []
        slots: list[int] = []
        for i, (query_len, seq_len, table) in enumerate(zip(query_lens, seq_lens, block_tables, strict=True)):
            if not 0 < query_len <= seq_len:
                raise ValueError(f"sequence {i}: need 0 < query_len <= seq_len, got {query_len}, {seq_len}")
            if len(table) * block_size < seq_len:
                raise ValueError(
                    f"sequence {i}: block table of {len(table)} blocks of {block_size} cannot hold "
                    f"{seq_len} tokens"
                )
            for pos in range(seq_len - query_len, seq_len):
                positions.append(pos)
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        width = max(len(t) for t in block_tables)
        padded_tables = [list(t) + [0] * (width - len(t)) for t in block_tables]
        starts = [0]
        for query_len in query_lens:
            starts.append(starts[-1] + query_len)

        def tensor(values: list) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        metadata = cls(
            query_start_loc=tensor(starts),
            seq_lens=tensor(seq_lens),
            block_tables=tensor(padded_tables),
            slot_mapping=tensor(slots),
            positions=tensor(positions),
            block_size=block_size,
            causal=causal,
            num_seqs=num_seqs,  # marks the derived fields as computed here, from the host lists
        )
        metadata._derive(query_lens, seq_lens, torch.device(device))
        return metadata

    def _derive(self, query_lens: list[int], seq_lens: list[int], device: torch.device) -> None:
        num_seqs = len(query_lens)
        max_query_len = max(query_lens)
        max_seq_len = max(seq_lens)
        num_blocks = -(-max_seq_len // self.block_size)
        self.num_seqs = num_seqs
        self.max_query_len = max_query_len
        self.max_seq_len = max_seq_len
        self.context_block_ids = self.block_tables[:, :num_blocks].reshape(-1)
        self._grouped_masks = {}
        self._window_masks = {}
        self._host_lens = (list(query_lens), list(seq_lens))
        self._split = None
        self._longest_row_scores = None

        uniform_queries = all(q == max_query_len for q in query_lens)
        if uniform_queries:
            self.query_pad_index = None
        else:
            self.query_pad_index = torch.tensor(
                [i * max_query_len + j for i, q in enumerate(query_lens) for j in range(q)],
                dtype=torch.int64,
            ).to(device, non_blocking=True)

        uniform_context = all(s == max_seq_len for s in seq_lens)
        causal_rows_differ = self.causal and max_query_len > 1
        self.needs_mask = not (uniform_context and not causal_rows_differ)
        self._attn_mask = None

    @property
    def attn_mask(self) -> torch.Tensor | None:
        """``[B, 1, max_query_len, max_seq_len]`` bool, True where a query may attend to a key; None
        when every query may see every key of its row (one sequence's decode, equal-length decodes)."""
        if self.needs_mask and self._attn_mask is None:
            self._attn_mask = self._build_mask()
        return self._attn_mask if self.needs_mask else None

    def _build_mask(self) -> torch.Tensor:
        """The mask from the step's tensors, on their device (nothing read back to the host)."""
        device = self.seq_lens.device
        key_pos = torch.arange(self.max_seq_len, device=device)
        allowed = (key_pos[None, :] < self.seq_lens[:, None])[:, None, :]  # [B, 1, L]
        if self.causal:
            # Query j of row b sits at position seq_len - query_len + j. Padding rows (j >=
            # query_len) land past the end and so see the whole context: never an empty row.
            query_lens = self.query_start_loc[1:] - self.query_start_loc[:-1]
            offsets = torch.arange(self.max_query_len, device=device)[None, :]
            query_pos = (self.seq_lens - query_lens)[:, None] + offsets
            allowed = allowed & (key_pos[None, None, :] <= query_pos[:, :, None])  # [B, Q, L]
        else:
            allowed = allowed.expand(self.num_seqs, self.max_query_len, self.max_seq_len)
        return allowed[:, None]

    def host_lens(self) -> tuple[list[int], list[int]]:
        """``(query_lens, seq_lens)`` as host lists: those :meth:`build` was given, else read back
        once (metadata made on the device, or rebuilt from its tensors in another process)."""
        if self._host_lens is None:
            starts = self.query_start_loc.tolist()
            self._host_lens = ([b - a for a, b in zip(starts[:-1], starts[1:], strict=True)], self.seq_lens.tolist())
        return self._host_lens

    def longest_row_scores(self) -> int:
        """The most query-key pairs that one row of the step scores: ``q`` new tokens over ``s`` keys
        score ``q * (s - q)`` cached pairs and, causally, ``q * (q + 1) / 2`` among themselves;
        worked out once per step, on the first layer that asks (:class:`InPlacePolicy`)."""
        if self._longest_row_scores is None:
            own = (lambda q: q * (q + 1) // 2) if self.causal else (lambda q: q * q)
            self._longest_row_scores = max(q * (s - q) + own(q) for q, s in zip(*self.host_lens(), strict=True))
        return self._longest_row_scores

    def split(self) -> StepSplit:
        """The step's rows for a step with a row of more than :data:`BATCHED_MAX_QUERIES`
        queries: the shorter rows as one batch, the longer ones one by one; built once per step."""
        if self._split is None:
            query_lens, seq_lens = self.host_lens()
            starts = list(accumulate(query_lens, initial=0))
            short = [i for i, q in enumerate(query_lens) if q <= BATCHED_MAX_QUERIES]
            long_rows = [
                LongRow(
                    start=starts[i],
                    query_len=query_lens[i],
                    seq_len=seq_lens[i],
                    block_ids=self.block_tables[i, : -(-seq_lens[i] // self.block_size)],
                    causal=self.causal,
                )
                for i, q in enumerate(query_lens)
                if q > BATCHED_MAX_QUERIES
            ]
            short_tokens = self._token_indices(short)
            self._split = StepSplit(self._subset(short, short_tokens) if short else None, short_tokens, long_rows)
        return self._split

    def _subset(self, rows: list[int], tokens: torch.Tensor) -> AttentionMetadata:
        """The metadata of sequences ``rows`` (indices into this step's, in order; their tokens
        are ``tokens`` of the flat batch) alone, as if they made the step by themselves."""
        query_lens, seq_lens = self.host_lens()
        device = self.query_start_loc.device
        sub_query_lens = [query_lens[i] for i in rows]
        sub_seq_lens = [seq_lens[i] for i in rows]
        index = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        metadata = AttentionMetadata(
            query_start_loc=torch.tensor(list(accumulate(sub_query_lens, initial=0)), dtype=torch.int64).to(device),
            seq_lens=self.seq_lens.index_select(0, index),
            block_tables=self.block_tables.index_select(0, index),
            slot_mapping=self.slot_mapping.index_select(0, tokens),
            positions=self.positions.index_select(0, tokens),
            block_size=self.block_size,
            causal=self.causal,
            num_seqs=len(rows),
        )
        metadata._derive(sub_query_lens, sub_seq_lens, device)
        return metadata

    def _token_indices(self, rows: list[int]) -> torch.Tensor:
        """The flat-batch indices of the tokens of sequences ``rows``, row by row."""
        starts = list(accumulate(self.host_lens()[0], initial=0))
        tokens = [t for i in rows for t in range(starts[i], starts[i + 1])]
        return torch.tensor(tokens, dtype=torch.int64).to(self.query_start_loc.device, non_blocking=True)

    def grouped_mask(self, n_rep: int) -> torch.Tensor | None:
        """:attr:`attn_mask` for the grouped-query layout of queries (rows ``rep * max_query_len + j``),
        built once per step and group size."""
        if self.attn_mask is None:
            return None
        mask = self._grouped_masks.get(n_rep)
        if mask is None:
            mask = self._grouped_masks[n_rep] = self.attn_mask.repeat(1, 1, n_rep, 1)
        return mask

    def window_mask(self, window: int, n_rep: int = 1) -> torch.Tensor | None:
        """:attr:`attn_mask` further limited to keys less than ``window`` positions behind their
        query; for ``n_rep > 1`` in the grouped-query layout like :meth:`grouped_mask`. Built on the
        device (no host read) once per step, window and group size.
        """
        if window >= self.max_seq_len:  # no query is far enough from position 0 to lose a key
            return self.attn_mask if n_rep == 1 else self.grouped_mask(n_rep)
        mask = self._window_masks.get((window, n_rep))
        if mask is None:
            mask = self._recent_keys(window) if n_rep == 1 else self.window_mask(window).repeat(1, 1, n_rep, 1)
            self._window_masks[(window, n_rep)] = mask
        return mask

    def _recent_keys(self, window: int) -> torch.Tensor:
        """``[B, 1, max_query_len, max_seq_len]`` bool: :attr:`attn_mask` and ``key > query - window``."""
        device = self.seq_lens.device
        query_lens = (self.query_start_loc[1:] - self.query_start_loc[:-1])[:, None]
        last = (self.seq_lens - 1)[:, None]
        # Query j of row b sits at seq_len - query_len + j; padding rows (j >= query_len) take the
        # last real query's window, so no row is left without a key.
        offsets = torch.arange(self.max_query_len, device=device)[None, :]
        query_pos = torch.minimum(last - query_lens + 1 + offsets, last)  # [B, Q]
        key_pos = torch.arange(self.max_seq_len, device=device)
        recent = (key_pos[None, None, :] > (query_pos - window)[:, :, None])[:, None]
        return recent if self.attn_mask is None else recent & self.attn_mask


class PagedAttention(nn.Module):
    """Writes a step's new K/V into the paged cache, then attends the new queries over each
    sequence's whole context (earlier tokens plus the new ones), with grouped-query heads.

    ``sliding_window``: attend only to the last ``sliding_window`` positions (see the module
    docstring); ``None`` attends to the whole context.
    """

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float | None = None,
        sliding_window: int | None = None,
    ) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be a positive number of positions, got {sliding_window}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.n_rep = num_heads // num_kv_heads
        self.scale = head_dim**-0.5 if scale is None else scale
        self.sliding_window = sliding_window

    def store(self, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slot_mapping: torch.Tensor) -> None:
        """Write ``[T, num_kv_heads, head_dim]`` keys and values at their flat cache slots, without
        attending (block drafters write their context's K/V this way)."""
        k_cache, v_cache = kv_cache
        kernels = cpu_kernels.for_tensor(k, v)
        if kernels is not None and k.stride(-1) == 1 and v.stride(-1) == 1 and k_cache.dtype == k.dtype:
            kernels.store_kv_(k, v, k_cache, v_cache, slot_mapping)
            return
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slot_mapping, v)

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """``q`` ``[T, num_heads, head_dim]``, ``k``/``v`` ``[T, num_kv_heads, head_dim]`` (positions
        already applied) -> ``[T, num_heads * head_dim]``.
        """
        self.store(k, v, kv_cache, metadata.slot_mapping)
        return self.attend(q, kv_cache, metadata)

    def attend_in_place(self, kernels: Any, q: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        """:meth:`attend` on Sonar's kernel, for a step that attends in place (:func:`attends_in_place`)
        with ``q`` of the caches' dtype, its last dimension contiguous."""
        k_cache, v_cache = kv_cache
        return kernels.paged_attention(
            q,
            k_cache,
            v_cache,
            metadata.block_tables,
            metadata.seq_lens,
            metadata.query_start_loc,
            self.scale,
            metadata.causal,
            self.sliding_window or 0,
        )

    def attend(self, q: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        """Attend ``q`` ``[T, num_heads, head_dim]`` over the context already in ``kv_cache``, writing
        nothing: a layer that reads another layer's cache (KV sharing) queries it this way."""
        k_cache, v_cache = kv_cache
        kv_heads, head_dim, n_rep = self.num_kv_heads, self.head_dim, self.n_rep
        window = self.sliding_window

        kernels = cpu_kernels.for_tensor(q) if attends_in_place(metadata, q.dtype) else None
        if kernels is not None and q.stride(-1) == 1 and k_cache.dtype == q.dtype:
            return self.attend_in_place(kernels, q, kv_cache, metadata)

        if metadata.max_query_len > BATCHED_MAX_QUERIES:
            return self._attend_split(q, kv_cache, metadata)

        num_seqs, max_q, max_len = metadata.num_seqs, metadata.max_query_len, metadata.max_seq_len
        ids = metadata.context_block_ids
        # [B, kv_heads, L, head_dim] views of the gathered blocks; positions past max_seq_len (the
        # tail of the last block) are sliced off, shorter rows are masked.
        keys = k_cache.index_select(0, ids).view(num_seqs, -1, kv_heads, head_dim)[:, :max_len].transpose(1, 2)
        values = v_cache.index_select(0, ids).view(num_seqs, -1, kv_heads, head_dim)[:, :max_len].transpose(1, 2)

        if max_q == 1:
            # Pure decode: [B, heads, D] is already [B, kv_heads, n_rep, D] grouped; no copies.
            mask = metadata.attn_mask if window is None else metadata.window_mask(window)
            out = F.scaled_dot_product_attention(
                q.view(num_seqs, kv_heads, n_rep, head_dim), keys, values, attn_mask=mask, scale=self.scale
            )
            return out.reshape(num_seqs, self.num_heads * head_dim)

        pad_index = metadata.query_pad_index
        if pad_index is not None:
            q = q.new_zeros(num_seqs * max_q, self.num_heads, head_dim).index_copy_(0, pad_index, q)
        # [B, Q, kv_heads, n_rep, D] -> [B, kv_heads, n_rep * Q, D]: each KV head's query group
        # becomes one block of rows.
        q = q.reshape(num_seqs, max_q, kv_heads, n_rep, head_dim).permute(0, 2, 3, 1, 4)
        q = q.reshape(num_seqs, kv_heads, n_rep * max_q, head_dim)
        mask = metadata.grouped_mask(n_rep) if window is None else metadata.window_mask(window, n_rep)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scale)
        # [B, kv_heads, n_rep, Q, D] -> [B, Q, heads * D]
        out = out.view(num_seqs, kv_heads, n_rep, max_q, head_dim).permute(0, 3, 1, 2, 4)
        out = out.reshape(num_seqs * max_q, self.num_heads * head_dim)
        if pad_index is not None:
            out = out.index_select(0, pad_index)
        return out

    def _attend_split(self, q: torch.Tensor, kv_cache: KVCache, metadata: AttentionMetadata) -> torch.Tensor:
        """:meth:`attend` for a step with long rows: see :meth:`AttentionMetadata.split`."""
        split = metadata.split()
        out = q.new_empty(q.shape[0], self.num_heads * self.head_dim)
        if split.short is not None:
            tokens = split.short_tokens
            out.index_copy_(0, tokens, self.attend(q.index_select(0, tokens), kv_cache, split.short))
        for row in split.long_rows:
            end = row.start + row.query_len
            out[row.start : end] = attend_long_row(q[row.start : end], kv_cache, row, self.scale, self.sliding_window)
        return out


@dataclass
class StepSplit:
    """A step's rows as attention takes them when one is long: ``short``, the rows of up to
    :data:`BATCHED_MAX_QUERIES` queries as one batch (None if there are none), whose tokens are
    ``short_tokens`` of the step's flat batch, and the others."""

    short: AttentionMetadata | None
    short_tokens: torch.Tensor
    long_rows: list[LongRow]
