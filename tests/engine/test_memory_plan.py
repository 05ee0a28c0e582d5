"""The memory plan: KV blocks within the budget, working memory that grows with max_num_seqs, and
out-of-memory errors worded as the user guide's troubleshooting section (max_num_seqs first)."""

from __future__ import annotations

import pytest
import torch

from sonar_core.config import EngineConfig
from sonar_core.engine import kv_budget
from sonar_core.engine.kv_budget import GIB, WorkingMemory, plan_kv_blocks
from sonar_core.errors import ConfigError
from sonar_core.kv import KVLayerSpec

SPECS = [KVLayerSpec(num_kv_heads=2, head_dim=64)] * 4  # 8 KiB per token in float32
VOCAB = 50_000


def _config(**fields) -> EngineConfig:
    return EngineConfig(device="cpu", max_model_len=1024, **fields)


def test_blocks_fill_the_budget_up_to_what_max_num_seqs_requests_need():
    per_block = kv_budget.bytes_per_block(SPECS, 16, torch.float32)
    few = plan_kv_blocks(_config(max_num_seqs=2, kv_cache_memory_gb=1.0), SPECS, torch.float32, 1024)
    assert few == 2 * (1024 // 16 + 1)  # capped by two full-length requests
    many = plan_kv_blocks(_config(max_num_seqs=256, kv_cache_memory_gb=0.25), SPECS, torch.float32, 1024)
    assert many == int(0.25 * GIB) // per_block


def test_working_memory_grows_with_max_num_seqs_and_probabilistic_drafting():
    greedy = WorkingMemory.of(_config(max_num_seqs=8), VOCAB, num_speculative_tokens=3, draft_probs=False)
    assert greedy.logits_bytes == 8 * 4 * VOCAB * 4 and greedy.draft_probs_bytes == 0
    sampled = WorkingMemory.of(_config(max_num_seqs=8), VOCAB, num_speculative_tokens=3, draft_probs=True)
    assert sampled.draft_probs_bytes == 8 * 3 * VOCAB * 4
    assert WorkingMemory.of(_config(max_num_seqs=4), VOCAB, 3, True).total * 2 == sampled.total


def test_a_cache_smaller_than_one_request_gives_the_guides_advice():
    with pytest.raises(ConfigError) as info:
        plan_kv_blocks(_config(kv_cache_memory_gb=0.001), SPECS, torch.float32, 1024)
    error = info.value
    assert error.field == "kv_cache_memory_gb"
    assert error.message.startswith("startup runs out of memory: the KV cache holds")
    assert error.fix.startswith("reduce --max-num-seqs first; then reduce the context length (--max-model-len)")
    assert "Probabilistic draft sampling retains draft probabilities" in error.fix


def test_on_the_cpu_lowering_max_num_seqs_is_what_makes_it_fit(monkeypatch):
    monkeypatch.setattr(kv_budget, "available_cpu_memory", lambda: int(0.5 * GIB))
    config = _config(max_num_seqs=256, kv_cache_memory_gb=0.25)
    working = WorkingMemory.of(config, VOCAB, num_speculative_tokens=7, draft_probs=True)
    with pytest.raises(ConfigError) as info:
        plan_kv_blocks(config, SPECS, torch.float32, 1024, working)
    assert "working memory for max_num_seqs=256" in info.value.message
    assert "keeps draft probabilities (probabilistic drafting)" in info.value.message
    assert "0.50 GiB this machine has available" in info.value.message
    fewer = _config(max_num_seqs=16, kv_cache_memory_gb=0.25)
    assert plan_kv_blocks(fewer, SPECS, torch.float32, 1024, WorkingMemory.of(fewer, VOCAB, 7, True)) > 0
