"""Prefix caching with a draft model: every full block gets its draft KV in the step where the target
fills it (drafting or not), so a request that starts after another one's cached blocks finds the
draft KV it would have written, drafts the same and outputs the same as without caching."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from aphrodite import LLM, SamplingParams
from sonar_core.testing.prefix_caching import check_followers_find_their_draft_kv, draft_kv, first_step

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _engines(target: Path, draft: Path, **engine) -> dict[bool, LLM]:
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    return {
        caching: LLM(model=str(target), dtype="float32", device="cpu", block_size=BLOCK, speculative_config=config,
                     enable_prefix_caching=caching, **engine)
        for caching in (False, True)
    }


def _prompts() -> tuple[list[int], list[list[int]]]:
    """A first prompt and followers sharing its first four blocks and more (a draft model's KV of a
    position depends on the tokens up to it only)."""
    rng = random.Random(9)
    prefix = [rng.randrange(3, 500) for _ in range(4 * BLOCK + 2)]
    first = prefix + [rng.randrange(3, 500) for _ in range(5)]
    return first, [prefix + [rng.randrange(3, 500) for _ in range(n)] for n in (1, 6)]


@pytest.mark.parametrize("first_tokens", [12, 1], ids=["cached-while-running", "cached-as-it-ends"])
def test_a_request_after_cached_blocks_finds_the_draft_kv_it_would_write(first_tokens, target, draft):
    engines = _engines(target, draft)
    cached_engine = engines[True]
    assert cached_engine.engine.prefix_caching and cached_engine.engine.block_manager.lookahead == 0
    first, followers = _prompts()
    check_followers_find_their_draft_kv(
        cached_engine, engines[False], first, first_tokens, [(p, 4 * BLOCK) for p in followers], GREEDY
    )
    assert cached_engine.get_spec_decode_metrics().num_draft_tokens > 0


def test_blocks_filled_by_prefill_chunks_without_drafting_hold_the_draft_kv(target, draft):
    """A prompt prefilled in chunks of 8 tokens by a request that never drafts (one new token)
    registers its first four blocks in steps without drafts; a follower that hits them finds the
    draft KV an engine without caching computes for it."""
    engine = _engines(target, draft, max_num_batched_tokens=8, max_num_seqs=2)[True].engine
    first, followers = _prompts()
    engine.add_request(first, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.block_manager.num_cached_blocks == 5
    uncached = _engines(target, draft)[False]
    for prompt in followers:
        hits = engine.prefix_cache_hits
        request_id = engine.add_request(prompt, GREEDY)
        engine.step()
        assert engine.prefix_cache_hits - hits == 4 * BLOCK
        seq = next(s for s in engine.scheduler.running if s.request_id == request_id)
        kv = draft_kv(engine, seq.block_table, 4 * BLOCK)
        while engine.has_unfinished_requests():
            engine.step()
        reference_kv = first_step(uncached, prompt, GREEDY)[1]
        for got, want in zip(kv, reference_kv, strict=True):
            torch.testing.assert_close(got, want[: 4 * BLOCK], rtol=1e-4, atol=1e-4)
    engine.block_manager.check_accounting()
