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
