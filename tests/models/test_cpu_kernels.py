"""Sonar's CPU kernels against the PyTorch operators they stand in for, and the fallback where
they cannot be built."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from sonar_core import cpu_kernels
from sonar_core.cpu_features import cpu_flags
from sonar_core.kv import KVLayerSpec, allocate_kv_cache
from sonar_core.layers import attention as attention_layers
from sonar_core.layers.attention import (
    AMX_BF16_IN_PLACE_MAX_SCORES,
    AttentionMetadata,
    InPlacePolicy,
    PagedAttention,
    attends_in_place,
    in_place_policy_for,
)
from sonar_core.layers.norms import RMSNorm, ZeroCentredRMSNorm
from sonar_core.layers.rotary import apply_rotary, rotate_
from sonar_core.sample.greedy import argmax_and_top_probability, argmax_rows

ops = cpu_kernels.load()
pytestmark = pytest.mark.skipif(ops is None, reason=f"CPU kernels unavailable: {cpu_kernels.problem()}")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def _random(*shape, dtype, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rms_norm_and_the_fused_residual_add_match_the_module(dtype):
    norm = RMSNorm(96, eps=1e-5).to(dtype)
    norm.weight.data = _random(96, dtype=dtype, seed=1)
    x, residual = _random(7, 96, dtype=dtype), _random(7, 96, dtype=dtype, seed=2)
    with torch.inference_mode():
        with cpu_kernels.disabled():
            expected = norm(residual + x)
        got_norm = ops.rms_norm(residual + x, norm.weight, 1e-5)
        got, summed = ops.add_rms_norm(x, residual, norm.weight, 1e-5)
    assert torch.equal(summed, residual + x)  # the add rounds exactly as PyTorch's does
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got_norm, expected, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    if dtype != torch.float32:
        # The float32 statistics may differ in their last bit; rounded to 16 bits, nearly every
        # element comes out identical.
        assert (got == expected).float().mean() > 0.95


def test_bfloat16_rounding_matches_pytorch_on_ties_infinities_and_nan():
    """The kernels round float32 to bfloat16 with bit operations; ties go to even, overflow to
    infinity and NaN stays NaN, as PyTorch rounds."""
    eighth = 2.0**-8  # half the bfloat16 spacing at 1.0: 1 + eighth is a tie
    x = torch.tensor([[1.0, 1.0, 3e38, float("inf"), float("nan"), -1.0, 0.0, 1.0]], dtype=torch.bfloat16)
    residual = torch.tensor(
        [[eighth, 3 * eighth, 3e38, 1.0, 1.0, -eighth, -0.0, float("-inf")]], dtype=torch.bfloat16
    )
    _, summed = ops.add_rms_norm(x, residual, torch.ones(8, dtype=torch.bfloat16), 1e-6)
    torch.testing.assert_close(summed, x + residual, rtol=0, atol=0, equal_nan=True)


def test_a_norm_that_scales_differently_keeps_its_own_add_and_norm():
    norm = ZeroCentredRMSNorm(32)
    norm.weight.data = _random(32, dtype=torch.float32, seed=5)
    x, residual = _random(3, 32, dtype=torch.float32), _random(3, 32, dtype=torch.float32, seed=6)
    with torch.inference_mode():
        normed, summed = norm.add_and_norm(x, residual)
        assert torch.equal(normed, norm(residual + x)) and torch.equal(summed, residual + x)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rotary_dim", [16, 8], ids=["full", "partial"])
def test_rotary_in_place_equals_apply_rotary(dtype, rotary_dim):
    qkv = _random(5, 4 * 16 + 8, dtype=dtype)
    qk = qkv[:, : 4 * 16].view(5, 4, 16)  # a strided view of a fused projection, as layers pass it
    cos, sin = _random(5, 1, rotary_dim, dtype=dtype, seed=3), _random(5, 1, rotary_dim, dtype=dtype, seed=4)
    expected = apply_rotary(qk.clone(), cos, sin)
    with torch.inference_mode():
        got = rotate_(qk, cos, sin)
    assert got.data_ptr() == qk.data_ptr()
    if dtype == torch.float32:  # a fused multiply-add may round the last bit differently
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
    else:  # the same rounding steps as x * cos then addcmul: equal to the bit
        assert torch.equal(got, expected)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_and_mul_matches_pytorch(dtype):
    x = _random(6, 2 * 40, dtype=dtype) * 4
    expected = F.silu(x[:, :40]) * x[:, 40:]
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(ops.silu_and_mul(x), expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("width", [1, 7, 16, 33, 49152])
def test_argmax_rows_picks_what_torch_argmax_picks(width):
    """Random rows, ties (the first maximum wins, in and after the vector part), a NaN anywhere
    (the first NaN wins), rows of -inf, and +inf."""
    gen = torch.Generator().manual_seed(width)
    rows = [torch.randn(width, generator=gen) for _ in range(4)]
    tied = torch.randn(width, generator=gen)
    tied[torch.randint(width, (3,), generator=gen)] = 9.0
    rows.append(tied)
    rows.append(torch.full((width,), 2.0))
    rows.append(torch.full((width,), float("-inf")))
    for spot in {0, width // 2, width - 1}:
        with_nan = torch.randn(width, generator=gen)
        with_nan[spot] = float("nan")
        rows.append(with_nan)
        with_inf = torch.randn(width, generator=gen)
        with_inf[spot] = float("inf")
        rows.append(with_inf)
    x = torch.stack(rows)
    assert torch.equal(ops.argmax_rows(x), x.argmax(dim=-1))
    picks, top = ops.argmax_rows_top(x)
    assert torch.equal(picks, x.argmax(dim=-1))
    expected = torch.softmax(x, dim=-1).amax(dim=-1)
    torch.testing.assert_close(top, expected, rtol=1e-5, atol=1e-7, equal_nan=True)


def test_greedy_picks_use_the_kernel_only_where_it_applies():
    """argmax_rows falls back to torch.argmax off the kernel's case (other dtypes, strided rows),
    with the same answer."""
    x = torch.randn(5, 300)
    x[2, 17] = x[2, 200] = 50.0
    for tensor in (x, x.to(torch.bfloat16), x.t().contiguous().t(), x[:, ::2]):
        assert torch.equal(argmax_rows(tensor), tensor.argmax(dim=-1))
    with cpu_kernels.disabled():
        assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_greedy_picks_with_their_probability_match_a_softmax_on_every_path():
    """argmax_and_top_probability: the pick and the softmax probability of it, from the kernel or
    from PyTorch's operators."""
    x = torch.randn(4, 300) * 3
    x[1, 40] = 30.0
    expected = torch.softmax(x, dim=-1).amax(dim=-1)
    for tensor in (x, x.t().contiguous().t()):
        picks, top = argmax_and_top_probability(tensor)
        assert torch.equal(picks, x.argmax(dim=-1))
        torch.testing.assert_close(top, expected, rtol=1e-5, atol=1e-7)
    with cpu_kernels.disabled():
        picks, top = argmax_and_top_probability(x)
    assert torch.equal(picks, x.argmax(dim=-1)) and torch.equal(top, expected)
    assert top[1] > 0.99


def _scenario(dtype, context_lens, query_lens, causal=True, heads=6, kv_heads=2, head_dim=32, block=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in zip(context_lens, query_lens, strict=True)]
    free = torch.randperm(64, generator=gen).tolist()
    tables = [[free.pop() for _ in range(-(-n // block))] for n in seq_lens]
    cache = allocate_kv_cache([KVLayerSpec(kv_heads, head_dim)], 64, block, dtype, "cpu")[0]
    cache[0].normal_(generator=gen)
    cache[1].normal_(generator=gen)
    metadata = AttentionMetadata.build(query_lens, seq_lens, tables, block, torch.device("cpu"), causal)
    q = torch.randn(sum(query_lens), heads, head_dim, generator=gen).to(dtype)
    return q, cache, metadata


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
@pytest.mark.parametrize("window", [None, 3], ids=["full", "window-3"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 128, 48])
def test_paged_attention_matches_the_gathering_path(dtype, window, causal, head_dim):
    """Ragged decode and multi-token rows alike, for the head sizes with compiled loops and one
    without, with 7 tokens of 3 heads per KV group (more rows than one 16-lane item holds)."""
    q, cache, metadata = _scenario(dtype, [0, 13, 5, 20], [7, 1, 4, 1], causal, heads=6, head_dim=head_dim)
    attention = PagedAttention(6, 2, head_dim, sliding_window=window)
    with torch.inference_mode():
        with cpu_kernels.disabled():
            expected = attention.attend(q, cache, metadata)
        got = ops.paged_attention(
            q, *cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
            attention.scale, causal, window or 0,
        )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("window", [None, 5], ids=["full", "window-5"])
@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_rows_of_several_queries_score_whole_blocks_of_keys_and_ignore_the_slots_past_them(
    dtype, head_dim, block, window
):
    """Blocks of a multiple of 16 slots let bfloat16 rows score 16 keys at a time on AMX tiles,
    straight from the cache: contexts over many such tiles, ending inside one, windows starting
    inside one, and NaN in every slot past a sequence's last key, which no row may pick up."""
    q, cache, metadata = _scenario(dtype, [0, 37, 100, 61], [6, 3, 12, 1], heads=6, head_dim=head_dim,
                                   block=block, seed=5)
    attention = PagedAttention(6, 2, head_dim, sliding_window=window)
    with torch.inference_mode():
        with cpu_kernels.disabled():
            expected = attention.attend(q, cache, metadata)
        for table, length in zip(metadata.block_tables.tolist(), metadata.seq_lens.tolist(), strict=True):
            last = table[(length - 1) // block]
            for layer_cache in cache:
                layer_cache[last, (length - 1) % block + 1 :] = float("nan")
        got = ops.paged_attention(
            q, *cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc,
            attention.scale, True, window or 0,
        )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
@pytest.mark.parametrize("heads,kv_heads", [(2, 2), (16, 2), (28, 4)], ids=["one-per-group", "8-per-group", "7-per-group"])
def test_decode_rows_match_the_gathering_path_for_any_heads_per_group(dtype, head_dim, heads, kv_heads):
    """Decode tokens read each key once for all the heads of their group, whose value sums go in
    passes of a few heads: one head per group, and more heads than one pass holds at every head
    size; contexts across several 16-key score chunks, one ending inside a chunk."""
    q, cache, metadata = _scenario(dtype, [40, 16, 1, 77], [1, 1, 1, 1], heads=heads, kv_heads=kv_heads,
                                   head_dim=head_dim, block=16, seed=3)
    attention = PagedAttention(heads, kv_heads, head_dim)
    with torch.inference_mode():
        with cpu_kernels.disabled():
            expected = attention.attend(q, cache, metadata)
        got = ops.paged_attention(
            q, *cache, metadata.block_tables, metadata.seq_lens, metadata.query_start_loc, attention.scale, True, 0
        )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


def test_layers_attend_in_place_for_decode_and_short_verification_steps(pin_in_place_limit):
    pin_in_place_limit(8)  # the query limit of AVX2 builds
    decode = AttentionMetadata.build([1, 1], [40, 900], [list(range(10)), list(range(10, 235))], 4, torch.device("cpu"))
    verify = AttentionMetadata.build([4], [40], [list(range(10))], 4, torch.device("cpu"))
    prefill = AttentionMetadata.build([9], [40], [list(range(10))], 4, torch.device("cpu"))
    assert attends_in_place(decode, torch.float32) and not attends_in_place(prefill, torch.float32)
    assert attends_in_place(verify, torch.float32) == bool(ops.attention_verifies_in_place())
    pin_in_place_limit(sys.maxsize)  # AVX-512 builds without AMX
    assert attends_in_place(prefill, torch.float32) == bool(ops.attention_verifies_in_place())


AVX512 = frozenset({"avx2", "avx512f", "avx512_bf16"})
AMX = AVX512 | {"amx_bf16"}


def _rows(query_lens: list[int], seq_lens: list[int], block: int = 16) -> AttentionMetadata:
    tables = [list(range(-(-s // block))) for s in seq_lens]
    return AttentionMetadata.build(query_lens, seq_lens, tables, block, torch.device("cpu"))


def test_cpus_without_amx_attend_every_step_in_place():
    """Kernels that share keys (AVX-512 builds) on a CPU without AMX stay in place at every row
    length, prompts included, and so does float32 with AMX (its SDPA has no tiles there); AVX2
    builds keep eight queries (not measured past it on long contexts), also when built for AVX2 on
    an AVX-512 CPU (docs/performance.md)."""
    unlimited = InPlacePolicy(sys.maxsize)
    for dtype in (torch.float32, torch.bfloat16):
        assert in_place_policy_for(AVX512, shares_keys=True, dtype=dtype) == unlimited
        assert in_place_policy_for(frozenset({"avx2", "fma"}), shares_keys=False, dtype=dtype) == InPlacePolicy(8)
        assert in_place_policy_for(AMX, shares_keys=False, dtype=dtype) == InPlacePolicy(8)
    assert in_place_policy_for(AMX, shares_keys=True, dtype=torch.float32) == unlimited
    assert in_place_policy_for(AMX, shares_keys=True, dtype=torch.float16) == unlimited


def test_bfloat16_with_amx_tiles_attends_in_place_where_blocks_hold_whole_tiles():
    """Kernels that score bfloat16 keys on AMX tiles win at every row length where the cache's
    blocks hold whole tiles of keys; with other blocks (vector scores) SDPA's tiles win for a row
    of many queries over a long context, and short rows still attend in place."""
    policy = in_place_policy_for(AMX, shares_keys=True, dtype=torch.bfloat16, tile_keys=16)
    for block in (16, 32):
        assert policy.takes(_rows([2048], [2048], block)) and policy.takes(_rows([363, 1], [507, 90], block))
    assert not policy.takes(_rows([2048], [2048], 8)) and policy.takes(_rows([9], [40], 8))
    assert in_place_policy_for(AMX, shares_keys=True, dtype=torch.float32, tile_keys=16) == InPlacePolicy(sys.maxsize)


@pytest.mark.parametrize("block", [8, 16])
def test_bfloat16_with_amx_but_no_tiles_gathers_rows_of_many_queries_over_many_keys(block):
    """Kernels without AMX tiles (a build for another instruction set): SDPA's bfloat16 tiles win for
    a row of many queries over a long context; short prompts, a batch of short prompts and a few
    tokens over a long cache still attend in place."""
    policy = in_place_policy_for(AMX, shares_keys=True, dtype=torch.bfloat16)
    assert policy.max_queries == 8 and policy.tile_keys == 0
    assert policy.takes(_rows([1, 1], [4000, 9000], block)) and policy.takes(_rows([8], [8008], block))
    assert policy.takes(_rows([220], [220], block)) and policy.takes(_rows([40] * 16, [40] * 16, block))
    assert policy.takes(_rows([16], [1040], block)) and policy.takes(_rows([48, 1], [560, 3000], block))
    assert not policy.takes(_rows([400], [400], block)) and not policy.takes(_rows([64], [576], block))
    assert not policy.takes(_rows([128], [1152], block))
    # 9 queries over 3,644 keys score 9 * 3,635 + 45 = 32,760 pairs, over 3,645 keys 32,769.
    assert _rows([9, 1], [3644, 3645], block).longest_row_scores() == AMX_BF16_IN_PLACE_MAX_SCORES - 8
    assert policy.takes(_rows([9], [3644], block)) and not policy.takes(_rows([9], [3645], block))


def test_this_process_attends_in_place_as_its_build_and_cpu_say():
    tile_keys = cpu_kernels.attention_tile_keys()
    assert tile_keys in (0, 16)
    for dtype in (torch.float32, torch.bfloat16):
        own = in_place_policy_for(cpu_flags(), cpu_kernels.attention_shares_keys(), dtype, tile_keys)
        expected = own if cpu_kernels.attention_verifies_in_place() else InPlacePolicy(1)
        assert attention_layers.in_place_policy(dtype) == expected


@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_each_row_gets_the_same_bits_whatever_else_the_step_holds(dtype, block):
    """A sequence verifying drafts gets the same attention for a token whatever else the step holds
    (other sequences, decode tokens, fewer drafts of its own), and a decode token the same as when
    decoded alone; verifying a token agrees with decoding it up to float rounding (the two take
    different loops: several queries share each key)."""
    q, cache, metadata = _scenario(dtype, [9, 30, 12], [4, 3, 1], block=block)

    def attend(rows, seqs, seq_lens, query_lens):
        starts = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()])
        return ops.paged_attention(
            q[rows], *cache, metadata.block_tables[seqs], torch.tensor(seq_lens), starts, 0.25, True, 0
        )

    lens = metadata.seq_lens.tolist()
    together = attend(slice(None), [0, 1, 2], lens, [4, 3, 1])
    # sequence 0 alone, and only its first three tokens
    assert torch.equal(attend(slice(0, 4), [0], lens[:1], [4]), together[:4])
    assert torch.equal(attend(slice(0, 3), [0], [lens[0] - 1], [3]), together[:3])
    # sequence 2's decode token alone
    assert torch.equal(attend(slice(7, 8), [2], lens[2:], [1]), together[7:])
    # each of sequence 1's tokens decoded one at a time
    decoded = torch.cat([attend(slice(4 + j, 5 + j), [1], [lens[1] - 2 + j], [1]) for j in range(3)])
    tolerance = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(decoded, together[4:7], rtol=tolerance, atol=tolerance)


def test_store_kv_writes_the_slots_and_refuses_slots_outside_the_cache():
    cache = allocate_kv_cache([KVLayerSpec(2, 8)], 4, 4, torch.float32, "cpu")[0]
    k, v = _random(3, 2, 8, dtype=torch.float32), _random(3, 2, 8, dtype=torch.float32, seed=1)
    slots = torch.tensor([5, 0, 15])
    ops.store_kv_(k, v, cache[0], cache[1], slots)
    assert torch.equal(cache[0].view(-1, 2, 8)[slots], k)
    assert torch.equal(cache[1].view(-1, 2, 8)[slots], v)
    with pytest.raises(RuntimeError, match="outside the cache"):
        ops.store_kv_(k, v, cache[0], cache[1], torch.tensor([0, 1, 16]))


def test_autograd_keeps_the_pytorch_path():
    """Training a head needs gradients, which the kernels do not give: the layers fall back."""
    norm = RMSNorm(8)
    x = torch.randn(2, 8)
    norm(x).sum().backward()
    assert norm.weight.grad is not None
    assert cpu_kernels.for_tensor(x, norm.weight) is None
    with torch.no_grad():
        assert cpu_kernels.for_tensor(x, norm.weight) is ops


PROBE = textwrap.dedent(
    """
    import logging, torch
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    from sonar_core import cpu_kernels
    from sonar_core.layers.norms import RMSNorm, ZeroCentredRMSNorm
    print("kernels:", cpu_kernels.load() is not None)
    with torch.inference_mode():
        print("norm runs:", RMSNorm(8)(torch.randn(2, 8)).shape == (2, 8))
    """
)


@pytest.mark.parametrize(
    "environment,reason",
    [({"CXX": "/nonexistent/c++"}, "no C++ compiler"), ({"SONAR_CPU_KERNELS": "0"}, None)],
    ids=["no-compiler", "switched-off"],
)
def test_without_a_compiler_or_switched_off_the_pytorch_operators_run(tmp_path, environment, reason):
    env = {**os.environ, "SONAR_CACHE_DIR": str(tmp_path), **environment}
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True)
    assert "kernels: False" in result.stdout and "norm runs: True" in result.stdout
    if reason:
        assert reason in result.stderr and "using PyTorch's operators" in result.stderr
    else:
        assert result.stderr == ""
