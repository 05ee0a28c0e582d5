"""Prefix caching of full KV blocks: lossless, exact block accounting, and off where it is unsafe.

Every engine test compares greedy outputs with an engine that has prefix caching off, and ends
with ``check_accounting()``: every block free or evictable and every reference count zero.
"""

from __future__ import annotations

import argparse
import logging
import random
from pathlib import Path

import pytest
from sequences import make_sequence

from aphrodite import LLM, SamplingParams
from sonar_core.engine.block_manager import BlockManager, hash_block_tokens, resolve_prefix_caching
from sonar_core.engine.scheduler import Scheduler
from sonar_core.entrypoints.args import add_engine_args, engine_config_from_args
from sonar_core.entrypoints.openai.metrics import EngineState, ServerMetrics, StatsRecorder
from sonar_core.errors import ConfigError
from sonar_core.kv import KVLayerSpec
from sonar_core.spec_decode.metrics import SpecDecodingStats
from sonar_core.spec_decode.proposer import ProposerCapabilities

BLOCK = 4
# One block of the tiny target (2 layers x K/V x 2 KV heads x 16 dims x 4 bytes x 4 tokens).
BLOCK_BYTES = 2048


def _greedy(max_tokens: int = 16) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def _shared_prefix_prompts(count: int, prefix_len: int = 41, seed: int = 0) -> list[list[int]]:
    """``count`` prompts of one long prefix and different suffixes, plus the prefix alone, a prompt
    of exactly whole blocks and a prompt shorter than the prefix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 512) for _ in range(prefix_len)]
    prompts = [prefix + [rng.randrange(3, 512) for _ in range(rng.randint(1, 9))] for _ in range(count)]
    return prompts + [list(prefix), prefix[:40], prefix[:23]]


def _outputs(llm: LLM, prompts: list[list[int]], max_tokens: int = 16) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, _greedy(max_tokens), use_tqdm=False)]


def _run_checked(llm: LLM, prompts: list[list[int]], max_tokens: int = 16) -> list[list[int]]:
    """Greedy outputs, stepping the engine by hand and checking after every step that the books
    balance and that no request has a block cached past its committed tokens."""
    engine = llm.engine
    ids = [engine.add_request(p, _greedy(max_tokens)) for p in prompts]
    results: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
        running = engine.scheduler.running
        engine.block_manager.check_accounting([s.block_table for s in running])
        for seq in running:
            assert seq.num_cached_blocks * BLOCK <= min(seq.num_computed_tokens, seq.num_tokens - 1)
    return [results[i] for i in ids]


def _assert_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    engine.block_manager.check_accounting()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


# ------------------------------------------------------------------------------- block manager
def test_block_hash_chains_the_parent_and_the_tokens():
    first = hash_block_tokens(None, [1, 2, 3, 4])
    assert first == hash_block_tokens(None, [1, 2, 3, 4])
    assert first != hash_block_tokens(None, [1, 2, 3, 5])
    second = hash_block_tokens(first, [5, 6, 7, 8])
    assert second != hash_block_tokens(hash_block_tokens(None, [0, 2, 3, 4]), [5, 6, 7, 8])
    assert second != hash_block_tokens(None, [5, 6, 7, 8])


def test_freed_cached_blocks_stay_usable_and_are_evicted_least_recently_freed_first():
    manager = BlockManager(num_blocks=4, block_size=BLOCK, enable_caching=True)
    h = [hash_block_tokens(None, [i] * BLOCK) for i in range(4)]
    a: list[int] = []
    assert manager.grow(a, 8)
    manager.register(a[0], h[0])
    manager.register(a[1], h[1])
    manager.check_accounting([a])
    # A second table takes the cached blocks: shared, reference counted.
    b: list[int] = []
    cached = manager.cached_blocks([h[0], h[1], h[2]])
    assert cached == a[:2]
    assert manager.can_take(cached, b, 9)
    manager.take(b, cached)
    assert manager.grow(b, 9)
    manager.check_accounting([a, b])
    assert manager.num_free_blocks == 1
    manager.free(a)
    manager.free(b)
    manager.check_accounting()
    # Both cached blocks survive as evictable and still count as free.
    assert manager.num_free_blocks == 4 and manager.num_cached_blocks == 2
    assert manager.cached_blocks([h[0], h[1]]) == cached
    # Uncached blocks go first; then the cached ones, the table's tail block first.
    c: list[int] = []
    assert manager.grow(c, 12)
    assert set(c[:2]).isdisjoint(cached) and c[2] == cached[1]
    assert manager.num_evictions == 1
    assert manager.cached_blocks([h[0], h[1]]) == [cached[0]]
    manager.check_accounting([c])
    manager.free(c)
    manager.check_accounting()


def test_taking_evictable_blocks_counts_against_the_free_pool():
    manager = BlockManager(num_blocks=3, block_size=BLOCK, enable_caching=True)
    a: list[int] = []
    manager.grow(a, 8)
    h0 = hash_block_tokens(None, [1] * BLOCK)
    h1 = hash_block_tokens(h0, [2] * BLOCK)
    manager.register(a[0], h0)
    manager.register(a[1], h1)
    manager.free(a)
    cached = manager.cached_blocks([h0, h1])
    assert manager.num_free_blocks == 3
    # Two cached blocks plus two new ones do not fit in three blocks, although three are "free".
    assert not manager.can_take(cached, [], 16)
    assert manager.can_take(cached, [], 12)


def test_double_free_and_writes_into_cached_blocks_are_caught():
    manager = BlockManager(num_blocks=4, block_size=BLOCK, enable_caching=True)
    a: list[int] = []
    manager.grow(a, 6)
    manager.register(a[0], hash_block_tokens(None, [1] * BLOCK))
    manager.check_writable(a, 4, 6)
    with pytest.raises(AssertionError, match="cached"):
        manager.check_writable(a, 3, 6)
    stale = list(a)
    manager.free(a)
    with pytest.raises(AssertionError, match="double free"):
        manager.free(stale)


def test_without_caching_nothing_is_cached():
    manager = BlockManager(num_blocks=4, block_size=BLOCK)
    a: list[int] = []
    manager.grow(a, 8)
    manager.register(a[0], hash_block_tokens(None, [1] * BLOCK))
    assert manager.num_cached_blocks == 0
    assert manager.cached_blocks([hash_block_tokens(None, [1] * BLOCK)]) == []
    manager.free(a)
    manager.check_accounting()


# ------------------------------------------------------------------------------------ the default
def test_default_is_on_only_where_lossless():
    spec = KVLayerSpec(num_kv_heads=2, head_dim=16)
    assert resolve_prefix_caching(None, None, False)
    assert not resolve_prefix_caching(False, None, False)
    assert resolve_prefix_caching(None, ProposerCapabilities(), False)  # ngram, suffix
    assert resolve_prefix_caching(None, ProposerCapabilities(target_final_hidden=True), False)  # Medusa
    unsafe = [
        (ProposerCapabilities(kv_layers=(spec,)), False, "KV layers of its own"),
        (ProposerCapabilities(target_hidden_layers=(0, 2)), False, "states at every position"),
        (None, True, "linear-attention"),
    ]
    for capabilities, recurrent, reason in unsafe:
        assert not resolve_prefix_caching(None, capabilities, recurrent)
        assert not resolve_prefix_caching(False, capabilities, recurrent)
        with pytest.raises(ConfigError, match=reason) as info:
            resolve_prefix_caching(True, capabilities, recurrent)
        assert info.value.field == "enable_prefix_caching"


def test_a_proposer_that_declares_its_reach_keeps_it_on():
    # EAGLE-3: KV layers and target states, written with the target's step, reaching one token on.
    eagle3 = ProposerCapabilities(
        kv_layers=(KVLayerSpec(num_kv_heads=2, head_dim=16),), target_hidden_layers=(0, 2), prefix_cache_lookahead=1
    )
    assert resolve_prefix_caching(None, eagle3, False) and resolve_prefix_caching(True, eagle3, False)
    assert not resolve_prefix_caching(None, eagle3, True)  # a linear-attention target still turns it off
    with pytest.raises(ValueError, match="prefix_cache_lookahead"):
        ProposerCapabilities(prefix_cache_lookahead=-1)


def test_the_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args([])).enable_prefix_caching is None
    assert engine_config_from_args(parser.parse_args(["--enable-prefix-caching"])).enable_prefix_caching is True


def test_the_hidden_state_exporter_turns_the_default_off(make_llm, tmp_path: Path):
    config = {"method": "extract_hidden_states", "output_dir": str(tmp_path), "layer_ids": [0, 2]}
    llm = make_llm(speculative_config=config, block_size=BLOCK)
    assert not llm.engine.prefix_caching
    # Every request is exported whole, the shared prefix included.
    prompts = _shared_prefix_prompts(2)
    _outputs(llm, prompts, max_tokens=4)
    assert len(list(tmp_path.glob("*.safetensors"))) == len(prompts)
    with pytest.raises(ConfigError, match="states at every position"):
        make_llm(speculative_config=config, enable_prefix_caching=True)


def test_a_linear_attention_target_turns_the_default_off(tmp_path: Path):
    from sonar_core.testing.mtp_layers import build_qwen3_next_target

    hybrid = build_qwen3_next_target(tmp_path / "qwen3-next", num_layers=4)
    llm = LLM(model=str(hybrid), dtype="float32", device="cpu")
    assert llm.engine.model.state_specs() and not llm.engine.prefix_caching
    with pytest.raises(ConfigError, match="linear-attention") as info:
        LLM(model=str(hybrid), dtype="float32", device="cpu", enable_prefix_caching=True)
    assert info.value.field == "enable_prefix_caching"


# ------------------------------------------------------------------------------------ scheduler
def _step(scheduler: Scheduler) -> None:
    """Pretend the model ran, as the engine's update does, then register the filled blocks."""
    out = scheduler.schedule()
    for item in out.scheduled:
        item.seq.num_computed_tokens += item.num_new_tokens
        if item.samples:
            item.seq.output_token_ids.append(7)
    scheduler.cache_full_blocks(out)
    return out


def test_a_request_starts_after_its_cached_prefix_but_always_computes_its_last_token():
    scheduler = Scheduler(BlockManager(64, BLOCK, enable_caching=True), max_num_seqs=8, max_num_batched_tokens=64)
    first = make_sequence("a", list(range(10)))
    scheduler.add(first)
    _step(scheduler)
    assert first.num_cached_blocks == 2  # positions 0..7 committed; the third block is partial
    aligned = make_sequence("b", list(range(8)))  # two whole blocks, both cached: the second is recomputed
    longer = make_sequence("c", list(range(9)) + [99])
    scheduler.add(aligned)
    scheduler.add(longer)
    out = scheduler.schedule()
    starts = {item.seq.request_id: (item.seq.num_computed_tokens, item.num_new_tokens) for item in out.scheduled}
    assert starts["b"] == (4, 4) and starts["c"] == (8, 2)
    assert aligned.block_table[0] == first.block_table[0] and aligned.block_table[1] != first.block_table[1]
    assert longer.block_table[:2] == first.block_table[:2]
    assert scheduler.prefix_cache_queries == 10 + 8 + 10 and scheduler.prefix_cache_hits == 4 + 8
    scheduler.block_manager.check_accounting([s.block_table for s in scheduler.running])
    for seq in list(scheduler.running):
        scheduler.finish(seq)
    scheduler.block_manager.check_accounting()


def test_with_a_lookahead_a_block_is_shared_only_with_the_token_after_it():
    manager = BlockManager(64, BLOCK, enable_caching=True, lookahead=1)
    scheduler = Scheduler(manager, max_num_seqs=8, max_num_batched_tokens=64)
    first = make_sequence("a", list(range(10)))
    scheduler.add(first)
    _step(scheduler)
    assert first.num_cached_blocks == 2  # 0..7, each hashed with the token after it (4, 8)
    same_next = make_sequence("b", list(range(9)) + [50])
    other_next = make_sequence("c", list(range(8)) + [60, 61])  # token 8 differs: the second block is not shared
    aligned = make_sequence("d", list(range(9)))  # the second block's next token is its newest, computed anyway
    for seq in (same_next, other_next, aligned):
        scheduler.add(seq)
    out = scheduler.schedule()
    starts = {item.seq.request_id: item.seq.num_computed_tokens for item in out.scheduled if item.seq is not first}
    assert starts == {"b": 8, "c": 4, "d": 8}
    assert other_next.block_table[0] == first.block_table[0] and other_next.block_table[1] != first.block_table[1]
    for seq in list(scheduler.running):
        scheduler.finish(seq)
    manager.check_accounting()
    with pytest.raises(ValueError, match="lookahead"):
        BlockManager(4, BLOCK, lookahead=-1)


def test_a_preempted_request_hits_its_own_blocks_when_it_returns():
    manager = BlockManager(6, BLOCK, enable_caching=True)
    scheduler = Scheduler(manager, max_num_seqs=2, max_num_batched_tokens=64)
    old, new = make_sequence("old", list(range(9))), make_sequence("new", list(range(100, 111)))
    scheduler.add(old)
    _step(scheduler)  # old: 3 blocks, 2 of them full
    scheduler.add(new)
    _step(scheduler)  # new: 3 blocks; the pool is empty
    for _ in range(4):
        out = _step(scheduler)
        if out.preempted:
            break
    assert new.num_preemptions == 1  # the latest arrival gives way
    manager.check_accounting([s.block_table for s in scheduler.running])
    scheduler.finish(old)
    hits = scheduler.prefix_cache_hits
    _step(scheduler)
    assert new.num_computed_tokens >= 8 and scheduler.prefix_cache_hits - hits >= 8
    scheduler.finish(new)
    manager.check_accounting()


# --------------------------------------------------------------------------------------- engine
def test_shared_prefixes_give_the_same_greedy_outputs_in_one_batch_and_across_batches(make_llm):
    prompts = _shared_prefix_prompts(6)
    plain = make_llm(block_size=BLOCK, enable_prefix_caching=False)
    expected = _outputs(plain, prompts)
    assert not plain.engine.prefix_caching and plain.engine.prefix_cache_hits == 0
    # A small token budget: the first prompt prefills in chunks and the others join as its blocks fill.
    cached = make_llm(block_size=BLOCK, max_num_batched_tokens=32, max_num_seqs=4)
    engine = cached.engine
    assert engine.prefix_caching
    assert _outputs(cached, prompts) == expected
    in_batch = engine.prefix_cache_hits
    assert in_batch >= 5 * 40
    _assert_idle(cached)
    # Across batches, one request at a time: each hits the prefix the earlier ones left cached.
    assert [_outputs(cached, [p])[0] for p in prompts] == expected
    assert engine.prefix_cache_hits - in_batch >= len(prompts) * 20
    assert engine.prefix_cache_queries == 2 * sum(len(p) for p in prompts)
    _assert_idle(cached)


def test_output_blocks_are_cached_too(make_llm):
    prompts = _shared_prefix_prompts(3, seed=1)
    plain = make_llm(block_size=BLOCK, enable_prefix_caching=False)
    cached = make_llm(block_size=BLOCK)
    first = _outputs(plain, prompts, max_tokens=24)
    assert _outputs(cached, prompts, max_tokens=24) == first
    # A follow-up turn: the prompt is the previous prompt and its output, whose blocks are cached.
    follow_ups = [p + out + [5, 6] for p, out in zip(prompts, first, strict=True)]
    hits = cached.engine.prefix_cache_hits
    assert _outputs(cached, follow_ups) == _outputs(plain, follow_ups)
    assert cached.engine.prefix_cache_hits - hits >= sum((len(p) + 20) // BLOCK * BLOCK for p in prompts) - 3 * BLOCK
    _assert_idle(cached)


def test_eviction_and_preemption_under_a_tiny_kv_cache(make_llm):
    prompts = _shared_prefix_prompts(8, seed=2)
    expected = _outputs(make_llm(block_size=BLOCK, enable_prefix_caching=False), prompts, max_tokens=24)
    # 30 blocks of 4 tokens: the shared prefix (10 blocks) and about two requests' own blocks.
    tight = make_llm(block_size=BLOCK, max_num_seqs=8, max_model_len=96, kv_cache_memory_gb=30 * BLOCK_BYTES / 2**30)
    engine = tight.engine
    assert engine.block_manager.num_blocks == 30
    assert _run_checked(tight, prompts, max_tokens=24) == expected
    assert engine.num_preemptions > 0
    assert engine.block_manager.num_evictions > 0
    assert engine.prefix_cache_hits > 0
    _assert_idle(tight)
    # Again, now that the cache is full of the first round's blocks.
    assert _outputs(tight, prompts[::-1], max_tokens=24) == expected[::-1]
    _assert_idle(tight)


def test_aborts_release_shared_blocks(make_llm):
    prompts = _shared_prefix_prompts(6, seed=3)
    expected = _outputs(make_llm(block_size=BLOCK, enable_prefix_caching=False), prompts)
    llm = make_llm(block_size=BLOCK, max_num_batched_tokens=24, max_num_seqs=4)
    engine = llm.engine
    ids = [engine.add_request(p, _greedy()) for p in prompts]
    aborted = {ids[1], ids[4], ids[-1]}
    results: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                results[output.request_id] = output.outputs[0].token_ids
        step += 1
        if step == 3:  # some are mid-prefill, some decoding, one not yet admitted
            for request_id in aborted:
                engine.abort_request(request_id)
        engine.block_manager.check_accounting([s.block_table for s in engine.scheduler.running])
    assert set(results) == set(ids) - aborted
    for request_id, prompt_out in zip(ids, expected, strict=True):
        if request_id not in aborted:
            assert results[request_id] == prompt_out
    assert engine.prefix_cache_hits > 0
    _assert_idle(llm)


def test_ngram_speculation_registers_only_committed_tokens(make_llm):
    rng = random.Random(4)
    prefix = [rng.randrange(3, 512) for _ in range(30)]
    # Repeating tails so that n-gram drafts come, and are partly rejected.
    prompts = [prefix + [40, 41, 42, 43] * 3 + [rng.randrange(3, 512)] for _ in range(3)]
    prompts += [prefix + [rng.randrange(3, 512) for _ in range(6)] * 2 for _ in range(3)]
    ngram = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}
    plain = make_llm(block_size=BLOCK, enable_prefix_caching=False)
    expected = _outputs(plain, prompts, max_tokens=24)
    llm = make_llm(block_size=BLOCK, speculative_config=ngram, max_num_seqs=2)
    engine = llm.engine
    assert engine.prefix_caching
    assert _run_checked(llm, prompts, max_tokens=24) == expected
    stats = engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    _assert_idle(llm)
    # Follow-ups hit the blocks that speculation filled (outputs included).
    follow_ups = [p + out for p, out in zip(prompts, expected, strict=True)]
    hits = engine.prefix_cache_hits
    assert _run_checked(llm, follow_ups) == _outputs(plain, follow_ups)
    assert engine.prefix_cache_hits - hits > sum(len(p) for p in prompts)
    _assert_idle(llm)


# -------------------------------------------------------------------------------------- metrics
def test_metrics_count_prefix_cache_tokens_and_the_log_shows_the_hit_rate(caplog):
    now = [0.0]
    metrics = ServerMetrics("m", 0)
    recorder = StatsRecorder(metrics, SpecDecodingStats(0), log_stats=True, interval_s=5.0, clock=lambda: now[0])
    recorder.observe_engine(EngineState(1, 0, 0.1, prefix_cache_queries=100, prefix_cache_hits=40))
    recorder.observe_engine(EngineState(1, 0, 0.1, prefix_cache_queries=150, prefix_cache_hits=60))
    text = metrics.render().decode()
    assert 'aphrodite:prefix_cache_queries_total{model_name="m"} 150.0' in text
    assert 'aphrodite:prefix_cache_hits_total{model_name="m"} 60.0' in text
    now[0] = 6.0
    with caplog.at_level(logging.INFO, logger="sonar.server"):
        recorder.maybe_log(EngineState(1, 0, 0.1, prefix_cache_queries=150, prefix_cache_hits=60))
    assert "Prefix cache hit rate: 40.0%" in caplog.text


def test_token_slice_is_a_slice_of_all_token_ids():
    seq = make_sequence("s", [1, 2, 3, 4, 5])
    seq.output_token_ids = [6, 7, 8]
    for start in range(10):
        for end in range(start, 11):
            assert seq.token_slice(start, end) == seq.all_token_ids[start:end]


def test_both_command_line_spellings_set_the_field():
    from sonar_core.bench.server_process import engine_flags
    from sonar_core.entrypoints.cli import build_parser
    from sonar_core.entrypoints.commands.serve import engine_config_from_args

    parser = build_parser()
    for flags, expected in (([], None), (["--enable-prefix-caching"], True), (["--no-enable-prefix-caching"], False)):
        args = parser.parse_args(["serve", *flags])
        assert engine_config_from_args(args).enable_prefix_caching is expected
    assert engine_flags({"enable_prefix_caching": False}) == ["--no-enable-prefix-caching"]
    assert engine_flags({"enable_prefix_caching": True, "enforce_eager": False}) == ["--enable-prefix-caching"]
