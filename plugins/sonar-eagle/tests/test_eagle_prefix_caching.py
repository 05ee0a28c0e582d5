"""Prefix caching with EAGLE heads: a request that starts after another request's cached blocks
finds the draft KV it would have written itself, and its output is the same as without caching.

EAGLE's draft KV at position ``t`` pairs the target's state at ``t`` with token ``t + 1``, so a
block is shared only between requests that also agree on the token after it
(``prefix_cache_lookahead=1``); the tests below build prompts that agree on whole blocks but not
on that token, and prompts that agree on both.
"""

from __future__ import annotations

import random

import pytest

from aphrodite import LLM, SamplingParams
from sonar_core.testing.branches import branch_on_every_step
from sonar_core.testing.prefix_caching import check_followers_find_their_draft_kv

BLOCK = 4
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
HEADS = {
    "eagle3": dict(method="eagle3", layout="speculators", draft_vocab_size=128),
    "eagle1": dict(method="eagle", layout="safeailab"),
}


def _prompts() -> tuple[list[int], list[list[int]]]:
    """A first prompt, then followers: one that agrees with it on four whole blocks but not on the
    token after them (the fourth block's draft KV differs, so only three blocks may be shared),
    and two that agree on the four blocks and the token after them."""
    rng = random.Random(5)
    prefix = [rng.randrange(3, 500) for _ in range(4 * BLOCK + 1)]
    first = prefix + [rng.randrange(3, 500) for _ in range(6)]
    other_next = prefix[: 4 * BLOCK] + [(prefix[4 * BLOCK] + 1) % 500 + 3] + [rng.randrange(3, 500) for _ in range(5)]
    same_next = [prefix + [rng.randrange(3, 500) for _ in range(n)] for n in (3, 8)]
    return first, [other_next, *same_next]


@pytest.mark.parametrize("branches", [1, 3], ids=["chain", "branches"])
@pytest.mark.parametrize("first_tokens", [12, 1], ids=["cached-while-running", "cached-as-it-ends"])
@pytest.mark.parametrize("head", list(HEADS))
def test_a_request_after_cached_blocks_finds_the_draft_kv_it_would_write(
    head, first_tokens, branches, target, make_head, monkeypatch
):
    """With one new token the first request ends in the step that prefills it, the step that also
    caches its blocks: the proposer must write their draft KV although the request is done. With
    draft branches, a fork copied back over the request's blocks must leave them as a chain would."""
    branch_on_every_step(monkeypatch)
    options = HEADS[head]
    config = {"method": options["method"], "model": str(make_head(target, **options)), "num_speculative_tokens": 3,
              "num_draft_branches": branches, "draft_stop_confidence": 0}
    engines = {
        caching: LLM(model=str(target), dtype="float32", device="cpu", block_size=BLOCK, speculative_config=config,
                     enable_prefix_caching=caching)
        for caching in (False, True)
    }
    cached_engine = engines[True]
    assert cached_engine.engine.prefix_caching and cached_engine.engine.block_manager.lookahead == 1
    first, followers = _prompts()
    expected_hits = [3 * BLOCK, 4 * BLOCK, 4 * BLOCK]
    check_followers_find_their_draft_kv(
        cached_engine, engines[False], first, first_tokens, list(zip(followers, expected_hits, strict=True)), GREEDY
    )
    assert cached_engine.get_spec_decode_metrics().num_draft_tokens > 0


@pytest.mark.parametrize(("branches", "step_tokens"), [(1, 12), (3, 20)], ids=["chain", "branches"])
def test_a_batch_sharing_prefixes_keeps_greedy_output(target, make_head, branches, step_tokens, monkeypatch):
    branch_on_every_step(monkeypatch)
    head = make_head(target, **HEADS["eagle3"])
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 4, "num_draft_branches": branches,
              "draft_stop_confidence": 0}
    first, followers = _prompts()
    prompts = [first, *followers] * 2

    def outputs(caching: bool, **engine) -> tuple[list[list[int]], LLM]:
        llm = LLM(model=str(target), dtype="float32", device="cpu", block_size=BLOCK, speculative_config=config,
                  enable_prefix_caching=caching, **engine)
        result = [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)]
        llm.engine.block_manager.check_accounting()
        return result, llm

    reference, _ = outputs(False)
    # Chunked prefill: later requests join while the first one's blocks fill.
    tokens, llm = outputs(True, max_num_seqs=3, max_num_batched_tokens=step_tokens)
    assert tokens == reference
    assert llm.engine.prefix_cache_hits > 0
