"""Checks for proposers that keep prefix caching on with KV layers of their own.

A request that starts after another request's cached blocks must find there the draft KV it would
have written itself. :func:`first_step` runs one request alone and returns what it found cached and
the draft KV of its prompt after its first step; comparing that with an engine without prefix
caching shows whether the cached blocks held the right draft KV::

    hits, kv, output = first_step(cached_llm, prompt, params)
    _, reference_kv, reference_output = first_step(uncached_llm, prompt, params)
"""

from __future__ import annotations

from typing import Any

import torch

from sonar_core.sampling_params import SamplingParams


def draft_kv(engine: Any, block_table: list[int], num_positions: int) -> list[torch.Tensor]:
    """The keys and values every proposer KV layer of ``engine`` (an ``LLMEngine``) holds for the
    first ``num_positions`` positions of ``block_table``."""
    blocks = torch.tensor(block_table)
    return [
        part.index_select(0, blocks).flatten(0, 1)[:num_positions].clone()
        for cache in engine.speculator.kv_caches
        for part in cache
    ]


def first_step(llm: Any, prompt: list[int], params: Any) -> tuple[int, list[torch.Tensor], list[int]]:
    """Run one request alone on an idle engine: the prompt tokens it found cached, the proposer's
    KV of its prompt after its first step (which prefills it and runs the proposer's first pass),
    and its output. Asserts that every block is free again afterwards."""
    engine = llm.engine
    hits = engine.prefix_cache_hits
    request_id = engine.add_request(prompt, params)
    engine.step()
    seq = engine.scheduler.running[0]
    assert seq.request_id == request_id and seq.num_computed_tokens == len(prompt), "the prompt did not fit one step"
    kv = draft_kv(engine, seq.block_table, len(prompt))
    cached = engine.prefix_cache_hits - hits
    output: list[int] = []
    while engine.has_unfinished_requests():
        for result in engine.step():
            if result.finished:
                output = result.outputs[0].token_ids
    manager = engine.block_manager
    manager.check_accounting()
    assert manager.num_free_blocks == manager.num_blocks, "KV blocks leaked"
    return cached, kv, output


def check_followers_find_their_draft_kv(
    cached_llm: Any,
    uncached_llm: Any,
    first: list[int],
    first_tokens: int,
    followers: list[tuple[list[int], int]],
    params: Any,
) -> None:
    """Run ``first`` alone on ``cached_llm`` for ``first_tokens`` new tokens (with 1 it ends in the
    step that prefills it, the step that also caches its blocks), then each ``(prompt, hits)``
    follower alone on both engines: the follower finds ``hits`` tokens cached, outputs what it
    outputs without caching, and holds the same proposer KV for its prompt up to rounding (the
    target ran those positions in steps of other shapes; another request's KV would differ in the
    leading digits)."""
    cached_llm.generate([first], SamplingParams(temperature=0.0, max_tokens=first_tokens, ignore_eos=True),
                        use_tqdm=False)
    assert cached_llm.engine.prefix_cache_hits == 0
    for prompt, hits in followers:
        found, kv, output = first_step(cached_llm, prompt, params)
        assert found == hits
        none, reference_kv, reference_output = first_step(uncached_llm, prompt, params)
        assert none == 0
        assert output == reference_output
        for got, want in zip(kv, reference_kv, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
