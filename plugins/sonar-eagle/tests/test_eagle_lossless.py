"""Greedy output with EAGLE speculation equals plain greedy output, token for token (float32), over
layouts, batch sizes, depths, chunked prefill, preemption and aborts; nothing leaks."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from aphrodite import LLM, SamplingParams
from sonar_core.engine.kv_budget import bytes_per_block
from sonar_core.engine.speculator import Speculator
from sonar_core.kv import KVLayerSpec
from sonar_core.spec_decode import chain_proposer
from sonar_core.testing.branches import branch_on_every_step
from sonar_core.testing.losslessness import outputs_with_aborts, random_prompts

GREEDY = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
HEADS = {
    "eagle3-speculators-reduced-vocab": dict(method="eagle3", layout="speculators", draft_vocab_size=128),
    "eagle3-safeailab": dict(method="eagle3", layout="safeailab"),
    "eagle1": dict(method="eagle", layout="safeailab"),
}


def _prompts(count: int, seed: int = 11) -> list[list[int]]:
    return random_prompts(count, seed=seed, max_len=45)


def _generate(target: Path, speculative_config=None, prompts=None, **engine) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=str(target), dtype="float32", device="cpu", speculative_config=speculative_config, **engine)
    outputs = llm.generate(prompts if prompts is not None else _prompts(10), GREEDY, use_tqdm=False)
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.fixture(scope="module")
def reference(target: Path) -> list[list[int]]:
    return _generate(target, max_num_seqs=8)[0]


@pytest.mark.parametrize("head", list(HEADS))
@pytest.mark.parametrize(("batch", "depth", "stop"), [(1, 1, None), (8, 3, None), (8, 6, 0.0)])
def test_greedy_output_equals_plain_output(head, batch, depth, stop, target, make_head, reference):
    """Chains that stop where the head is unsure (the default draft_stop_confidence), and chains
    always at full depth (0)."""
    options = HEADS[head]
    config = {"method": options["method"], "model": str(make_head(target, **options)), "num_speculative_tokens": depth}
    if stop is not None:
        config["draft_stop_confidence"] = stop
    tokens, llm = _generate(target, config, max_num_seqs=batch)
    assert tokens == reference
    assert llm.get_spec_decode_metrics().num_draft_tokens > 0


@pytest.mark.parametrize("head", ["eagle3-speculators-reduced-vocab", "eagle1"])
@pytest.mark.parametrize(("batch", "depth", "branches"), [(1, 1, 3), (8, 3, 2), (8, 4, 3)])
def test_draft_branches_keep_greedy_output(head, batch, depth, branches, target, make_head, reference, monkeypatch):
    """Each request's chain and its branches (the head's next best first tokens) are verified side
    by side in KV forks; whichever the target follows, the output is the plain one. Every drafting
    request gets its branches, however many rows a step verifies."""
    branch_on_every_step(monkeypatch)
    options = HEADS[head]
    config = {"method": options["method"], "model": str(make_head(target, **options)),
              "num_speculative_tokens": depth, "num_draft_branches": branches, "draft_stop_confidence": 0}
    tokens, llm = _generate(target, config, max_num_seqs=batch, block_size=4)
    assert tokens == reference
    assert llm.get_spec_decode_metrics().num_draft_tokens > 0


@pytest.mark.parametrize(("confidence", "branching"), [(0.0, False), (math.inf, True)], ids=["sure", "unsure"])
def test_a_head_sure_of_its_first_draft_drafts_no_branches(confidence, branching, target, make_head, reference,
                                                           monkeypatch):
    """Branches are forked only where the head's probability of its first draft is below
    BRANCH_CONFIDENCE: at 0 every head is sure (chains alone), at infinity none is."""
    branch_on_every_step(monkeypatch)
    monkeypatch.setattr(chain_proposer, "BRANCH_CONFIDENCE", confidence)
    forked = []
    fork = Speculator._fork

    def counting(self, request, count):
        forks = fork(self, request, count)
        forked.extend(forks)
        return forks

    monkeypatch.setattr(Speculator, "_fork", counting)
    tokens, llm = _generate(target, _branching_config(target, make_head), max_num_seqs=4, block_size=4)
    assert tokens == reference
    assert bool(forked) == branching
    assert llm.get_spec_decode_metrics().num_draft_tokens > 0


@pytest.mark.parametrize("branches", [1, 3], ids=["chains-alone", "with-branches"])
@pytest.mark.parametrize(("stop", "depth"), [(0.0, 3), (1.0, 1)])
def test_chains_stop_where_the_head_runs_out_of_probability(branches, stop, depth, target, make_head, reference,
                                                            monkeypatch):
    """A request drafts no deeper once none of its chains holds draft_stop_confidence of the head's
    probability: at 0 every chain runs its three drafts, at 1 every request keeps its first drafts
    only (a random head is never certain); the output is the plain one either way."""
    branch_on_every_step(monkeypatch)
    config = {**_branching_config(target, make_head), "num_draft_branches": branches, "draft_stop_confidence": stop}
    tokens, llm = _generate(target, config, max_num_seqs=4, block_size=4)
    assert tokens == reference
    metrics = llm.get_spec_decode_metrics()
    if depth == 1:
        assert metrics.num_draft_tokens == metrics.num_drafts > 0
    else:
        assert metrics.num_draft_tokens > 2 * metrics.num_drafts


def _branching_config(target: Path, make_head) -> dict:
    options = HEADS["eagle3-speculators-reduced-vocab"]
    return {"method": "eagle3", "model": str(make_head(target, **options)), "num_speculative_tokens": 3,
            "num_draft_branches": 3, "draft_stop_confidence": 0}


@pytest.mark.parametrize("head", ["eagle3-speculators-reduced-vocab", "eagle1"])
def test_chunked_prefill_keeps_greedy_output(head, target, make_head, reference):
    options = HEADS[head]
    config = {"method": options["method"], "model": str(make_head(target, **options)), "num_speculative_tokens": 3}
    tokens, _ = _generate(target, config, max_num_seqs=4, max_num_batched_tokens=8)
    assert tokens == reference


def test_preemption_keeps_greedy_output_and_frees_everything(target, make_head, reference):
    head = make_head(target, **HEADS["eagle3-speculators-reduced-vocab"])
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 4}
    # Target (8 layers) and draft (1 layer) KV of 2 heads x 16 dims, fp32, blocks of 4 tokens:
    # 30 blocks hold about two full requests, so later ones preempt earlier ones.
    per_block = bytes_per_block([KVLayerSpec(2, 16)] * 9, 4, torch.float32)
    tokens, llm = _generate(
        target, config, max_num_seqs=8, block_size=4, max_model_len=96, kv_cache_memory_gb=30 * per_block / 2**30
    )
    assert tokens == reference
    assert llm.engine.num_preemptions > 0


def test_aborted_requests_free_their_blocks_and_leave_others_intact(target, make_head, reference):
    head = make_head(target, **HEADS["eagle3-safeailab"])
    llm = LLM(model=str(target), dtype="float32", device="cpu",
              speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    aborted = set(range(0, 10, 3))
    finished, all_freed = outputs_with_aborts(llm.engine, _prompts(10), GREEDY, aborted, abort_at_step=3)
    assert finished == {i: reference[i] for i in range(10) if i not in aborted}
    assert all_freed


def test_qwen3_layers_in_a_speculators_head(qwen3_target, make_head):
    head = make_head(qwen3_target, method="eagle3", layout="speculators", draft_vocab_size=100)
    plain, _ = _generate(qwen3_target, prompts=_prompts(4))
    tokens, llm = _generate(qwen3_target, {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3},
                            prompts=_prompts(4))
    assert tokens == plain
    # The head's layers are Qwen3 layers: per-head q/k norms were loaded.
    layer = llm.engine.speculator.proposer.head.layers[0]
    assert layer.self_attn.qk_norm


def test_probabilistic_drafting_keeps_greedy_output(target, make_head, reference):
    head = make_head(target, **HEADS["eagle3-speculators-reduced-vocab"])
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "draft_sample_method": "probabilistic"}
    tokens, llm = _generate(target, config, max_num_seqs=8)
    assert tokens == reference
    assert llm.engine.speculator.capabilities.returns_draft_probs


def test_the_head_shares_the_targets_modules(target, make_head):
    head = make_head(target, **HEADS["eagle1"])
    llm = LLM(model=str(target), dtype="float32", device="cpu",
              speculative_config={"method": "eagle", "model": str(head), "num_speculative_tokens": 2})
    model = llm.engine.model
    eagle = llm.engine.speculator.proposer.head
    assert eagle._shared.lm_head is model.lm_head
    assert eagle._shared.embed_tokens is model.model.embed_tokens
    names = {name for name, _ in eagle.named_parameters()}
    assert not any(name.startswith(("lm_head", "embed_tokens")) for name in names)
