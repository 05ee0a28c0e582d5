"""PagedAttention and AttentionMetadata against a naive per-sequence reference."""

from __future__ import annotations

import math
import random

import pytest
import torch

from sonar_core import cpu_kernels
from sonar_core.kv import KVLayerSpec, allocate_kv_cache
from sonar_core.layers.attention import AttentionMetadata, PagedAttention
from sonar_core.layers.rotary import RopeConfig
from sonar_core.spec_decode.draft_attention import DraftChain

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 6, 2, 8, 4


@pytest.fixture(autouse=True, params=["cpu-kernels", "pytorch"])
def attention_path(request):
    """Every case on both CPU paths: Sonar's kernel reading the cache in place (where it is built)
    and the gather + PyTorch SDPA path (prefill chunks, CUDA, machines without a compiler)."""
    if request.param == "pytorch":
        with cpu_kernels.disabled():
            yield request.param
    else:
        yield request.param


def naive_attention(q, keys, values, query_len, causal, window=None):
    """One sequence: q [q_len, H, D] over keys/values [L, Hkv, D] (the last q_len are the new ones);
    ``window``: each query sees only keys less than ``window`` positions behind it."""
    rep = q.shape[1] // keys.shape[1]
    keys = keys.repeat_interleave(rep, dim=1)
    values = values.repeat_interleave(rep, dim=1)
    seq_len = keys.shape[0]
    scores = torch.einsum("qhd,khd->hqk", q, keys) / math.sqrt(q.shape[-1])
    if causal:
        query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] > query_pos, float("-inf"))
    if window is not None:
        query_pos = torch.arange(seq_len - query_len, seq_len)[:, None]
        scores = scores.masked_fill(torch.arange(seq_len)[None, :] <= query_pos - window, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), values).reshape(query_len, -1)


class Scenario:
    """Random sequences with scattered block tables, their full K/V history, and a cache holding
    all but each sequence's new tokens."""

    def __init__(self, context_lens, query_lens, seed=0):
        gen = torch.Generator().manual_seed(seed)
        rng = random.Random(seed)
        self.query_lens = query_lens
        self.seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
        free = list(range(64))
        rng.shuffle(free)
        self.tables = [[free.pop() for _ in range(-(-n // BLOCK))] for n in self.seq_lens]
        self.cache = allocate_kv_cache([KVLayerSpec(KV_HEADS, HEAD_DIM)], 64, BLOCK, torch.float32, "cpu")[0]
        # Garbage everywhere except what a sequence wrote: masking must hide it.
        self.cache[0].normal_(generator=gen)
        self.cache[1].normal_(generator=gen)
        self.keys = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) for n in self.seq_lens]
        self.values = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) for n in self.seq_lens]
        self.q = [torch.randn(q, HEADS, HEAD_DIM, generator=gen) for q in query_lens]
        for table, keys, values, context in zip(self.tables, self.keys, self.values, context_lens, strict=True):
            for pos in range(context):
                block, offset = table[pos // BLOCK], pos % BLOCK
                self.cache[0][block, offset] = keys[pos]
                self.cache[1][block, offset] = values[pos]

    def run(self, causal, device="cpu", window=None):
        metadata = AttentionMetadata.build(
            self.query_lens, self.seq_lens, self.tables, BLOCK, torch.device(device), causal
        )
        new = [slice(s - q, s) for s, q in zip(self.seq_lens, self.query_lens, strict=True)]
        q = torch.cat(self.q)
        k = torch.cat([keys[n] for keys, n in zip(self.keys, new, strict=True)])
        v = torch.cat([values[n] for values, n in zip(self.values, new, strict=True)])
        cache = tuple(c.to(device) for c in self.cache)  # the cache itself on the CPU
        attention = PagedAttention(HEADS, KV_HEADS, HEAD_DIM, sliding_window=window)
        out = attention(q.to(device), k.to(device), v.to(device), cache, metadata)
        return out.cpu(), metadata

    def reference(self, causal, window=None):
        return torch.cat(
            [
                naive_attention(q, keys, values, len(q), causal, window)
                for q, keys, values in zip(self.q, self.keys, self.values, strict=True)
            ]
        )


SHAPES = [
    pytest.param([0], [1], id="first-token"),
    pytest.param([200], [1], id="decode-batch1"),
    pytest.param([7, 12, 3], [1, 1, 1], id="decode-ragged"),
    pytest.param([8, 8], [1, 1], id="decode-equal"),
    pytest.param([0], [9], id="prefill"),
    pytest.param([0, 0, 0], [5, 11, 2], id="prefill-ragged"),
    pytest.param([9], [6], id="prefill-second-chunk"),
    pytest.param([0, 13, 5, 20], [7, 1, 4, 1], id="mixed"),
    pytest.param([4, 4], [3, 3], id="uniform-queries"),
    # Rows longer than BATCHED_MAX_QUERIES (8) split a step that does not attend in place: short
    # rows batched, long ones alone. AVX-512 builds on CPUs without AMX attend them in place.
    pytest.param([13, 0, 30, 6, 2], [1, 20, 18, 3, 1], id="split-decodes-prompt-chunk"),
    pytest.param([0, 5], [24, 17], id="split-long-only"),
    pytest.param([37, 1], [70, 1], id="long-chunk-after-context"),
    # More new tokens than cached ones, past SPAN_QUERIES: the gathered path attends them in
    # spans of queries, each over the keys up to its last query.
    pytest.param([40, 1], [200, 1], id="long-row-in-query-spans"),
]


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("context_lens,query_lens", SHAPES)
def test_paged_attention_matches_reference(context_lens, query_lens, causal):
    scenario = Scenario(context_lens, query_lens)
    out, _ = scenario.run(causal)
    torch.testing.assert_close(out, scenario.reference(causal), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("window", [1, 3, 8])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("context_lens,query_lens", SHAPES)
def test_sliding_window_matches_reference(context_lens, query_lens, causal, window):
    """Windows shorter than the prompt, than a prefill chunk, and of one position (the query alone)."""
    scenario = Scenario(context_lens, query_lens)
    out, _ = scenario.run(causal, window=window)
    torch.testing.assert_close(out, scenario.reference(causal, window), rtol=1e-5, atol=1e-5)


def test_sliding_window_mask_of_chained_draft_metadata_equals_build():
    """Chained draft steps make their metadata without build(); its window mask must agree."""
    positions, tables = [9, 2, 14], [[0, 1, 2], [3], [4, 5, 6, 7]]
    built = AttentionMetadata.build([1, 1, 1], [p + 1 for p in positions], tables, BLOCK, torch.device("cpu"))
    device = DraftChain(positions, positions, tables, BLOCK, "cpu").metadata()
    assert torch.equal(device.window_mask(4), built.window_mask(4))
    assert device.window_mask(4)[:, 0, 0].sum(-1).tolist() == [4, 3, 4]
    # A window that covers every key adds no mask term.
    assert built.window_mask(15) is built.attn_mask


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("window", [None, 3], ids=["full", "window-3"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("context_lens,query_lens", SHAPES)
def test_paged_attention_on_cuda_matches_reference(context_lens, query_lens, causal, window):
    scenario = Scenario(context_lens, query_lens)
    out, _ = scenario.run(causal, device="cuda", window=window)
    # CUDA kernels order their reductions differently.
    torch.testing.assert_close(out, scenario.reference(causal, window), rtol=1e-4, atol=1e-4)


def test_new_tokens_are_written_to_their_slots():
    scenario = Scenario([6, 0], [3, 5])
    _, metadata = scenario.run(causal=True)
    flat_k = scenario.cache[0].view(-1, KV_HEADS, HEAD_DIM)
    for i, (table, keys) in enumerate(zip(scenario.tables, scenario.keys, strict=True)):
        for pos in range(scenario.seq_lens[i]):
            torch.testing.assert_close(flat_k[table[pos // BLOCK] * BLOCK + pos % BLOCK], keys[pos])
    assert metadata.positions.tolist() == [6, 7, 8, 0, 1, 2, 3, 4]


def test_non_causal_block_sees_all_its_new_tokens():
    """Non-causal: the first new token's output depends on the last new token's K/V; causal: not."""
    base = Scenario([5], [4], seed=3)
    changed = Scenario([5], [4], seed=3)
    changed.keys[0][-1] += 1.0
    changed.values[0][-1] += 1.0
    for causal, should_change in ((True, False), (False, True)):
        first = base.run(causal)[0][0]
        first_changed = changed.run(causal)[0][0]
        assert (not torch.allclose(first, first_changed)) == should_change
    # And the earlier context is visible to every new token in both modes.
    mask = AttentionMetadata.build([4], [9], [[0, 1, 2]], BLOCK, torch.device("cpu"), causal=False).attn_mask
    assert mask is None or bool(mask[..., :9].all())


def test_metadata_masks_only_when_needed():
    cpu = torch.device("cpu")
    assert AttentionMetadata.build([1], [50], [list(range(13))], BLOCK, cpu).attn_mask is None
    assert AttentionMetadata.build([1, 1], [9, 9], [[0, 1, 2], [3, 4, 5]], BLOCK, cpu).attn_mask is None
    ragged = AttentionMetadata.build([1, 1], [9, 3], [[0, 1, 2], [3]], BLOCK, cpu)
    assert ragged.attn_mask is not None and ragged.attn_mask[1, 0, 0].tolist() == [True] * 3 + [False] * 6
    prefill = AttentionMetadata.build([3], [5], [[0, 1]], BLOCK, cpu)
    assert prefill.attn_mask[0, 0].tolist() == [
        [True, True, True, False, False],
        [True, True, True, True, False],
        [True, True, True, True, True],
    ]
    assert AttentionMetadata.build([3], [5], [[0, 1]], BLOCK, cpu, causal=False).attn_mask is None


def test_long_rows_attend_alone_and_short_rows_together():
    """A prompt joining decodes must not pad them to its length: the split keeps the decodes one
    batch, and a fresh prompt needs no mask (SDPA's causal flag), a chunk after context does."""
    cpu = torch.device("cpu")
    tables = [[0, 1, 2], [3, 4, 5], [6, 7, 8, 9, 10], [11, 12]]
    metadata = AttentionMetadata.build([1, 12, 10, 2], [9, 12, 20, 7], tables, BLOCK, cpu)
    split = metadata.split()
    assert split.short is not None and split.short.max_query_len == 2
    assert split.short_tokens.tolist() == [0, 23, 24]
    assert split.short.seq_lens.tolist() == [9, 7] and split.short.block_tables.tolist() == [[0, 1, 2, 0, 0], [11, 12, 0, 0, 0]]
    fresh, chunk = split.long_rows
    assert (fresh.start, fresh.query_len, fresh.seq_len, fresh.block_ids.tolist()) == (1, 12, 12, [3, 4, 5])
    assert fresh.mask(None, torch.float32) == (None, True)
    mask, is_causal = chunk.mask(None, torch.float32)
    assert not is_causal and mask.shape == (10, 20)
    assert torch.equal(mask == 0, torch.arange(20)[None, :] <= torch.arange(10, 20)[:, None])
    # A window that cuts keys needs a mask even for a fresh prompt; one as long as the row does not.
    assert fresh.mask(4, torch.float32)[0] is not None and fresh.mask(12, torch.float32) == (None, True)
    assert AttentionMetadata.build([12], [12], [[3, 4, 5]], BLOCK, cpu).split().short is None


def test_metadata_from_tensors_equals_build():
    built = AttentionMetadata.build([2, 1], [6, 4], [[3, 1], [2]], BLOCK, torch.device("cpu"))
    direct = AttentionMetadata(
        query_start_loc=built.query_start_loc,
        seq_lens=built.seq_lens,
        block_tables=built.block_tables,
        slot_mapping=built.slot_mapping,
        positions=built.positions,
        block_size=BLOCK,
    )
    assert (direct.num_seqs, direct.max_query_len, direct.max_seq_len) == (2, 2, 6)
    assert torch.equal(direct.context_block_ids, built.context_block_ids)
    assert torch.equal(direct.query_pad_index, built.query_pad_index)
    assert torch.equal(direct.attn_mask, built.attn_mask)
    assert built.slot_mapping.tolist() == [1 * BLOCK + 0, 1 * BLOCK + 1, 2 * BLOCK + 3]
    assert built.block_tables.tolist() == [[3, 1], [2, 0]]


@pytest.mark.parametrize(
    "query_lens,seq_lens,tables,message",
    [
        ([2], [1], [[0]], "query_len <= seq_len"),
        ([0], [3], [[0]], "query_len <= seq_len"),
        ([1], [9], [[0, 1]], "cannot hold 9 tokens"),
        ([1, 1], [2], [[0]], "equal length"),
    ],
)
def test_metadata_rejects_inconsistent_input(query_lens, seq_lens, tables, message):
    with pytest.raises(ValueError, match=message):
        AttentionMetadata.build(query_lens, seq_lens, tables, BLOCK, torch.device("cpu"))


def test_gqa_requires_divisible_heads():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        PagedAttention(5, 2, 8)
    with pytest.raises(ValueError, match="sliding_window must be a positive"):
        PagedAttention(4, 2, 8, sliding_window=0)


@pytest.mark.parametrize(
    "params",
    [
        {"rope_type": "default", "rope_theta": 10000.0},
        {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
        {
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ],
    ids=lambda p: p["rope_type"],
)
def test_rope_frequencies_match_transformers(params):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=512, num_attention_heads=4, rope_parameters=dict(params))
    ours = RopeConfig.from_hf_config(config, head_dim=128).inv_freq()
    if params["rope_type"] == "default":
        theirs = 1.0 / (params["rope_theta"] ** (torch.arange(0, 128, 2, dtype=torch.float) / 128))
    else:
        theirs, _ = ROPE_INIT_FUNCTIONS[params["rope_type"]](config)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)


def test_unsupported_rope_is_refused():
    from transformers import LlamaConfig

    config = LlamaConfig(rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(ValueError, match="'yarn' is not supported"):
        RopeConfig.from_hf_config(config, head_dim=64)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_cpu_caches_are_zero_writable_and_independent(dtype):
    """The CPU cache is allocated zeroed lazily (calloc pages, not a memset): it must read as
    exact zeros, take writes, and share no memory between tensors."""
    (k, v), (k2, v2) = allocate_kv_cache([KVLayerSpec(2, 8), KVLayerSpec(1, 4, value_head_dim=0)], 5, 4, dtype, "cpu")
    assert k.shape == (5, 4, 2, 8) and v.shape == (5, 4, 2, 8) and k2.shape == (5, 4, 1, 4) and v2.numel() == 0
    assert k.dtype == v.dtype == dtype and k.is_contiguous()
    assert not k.any() and not v.any() and not k2.any()
    k[1, 2, 0, 3] = 1.5
    assert float(k.sum()) == 1.5 and not v.any() and not k2.any()
