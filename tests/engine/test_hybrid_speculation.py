"""Speculation on a hybrid linear-attention target (Qwen3-Next) stays lossless.

A verification step advances each request's recurrent state through its drafts; the engine keeps
the state after every uncommitted token and commits the accepted one. Greedy output with n-gram,
draft-model and MTP speculation must therefore equal plain output token for token, across
batches, depths, chunked prefill, preemption and aborts, and every state slot must come back.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from aphrodite import LLM, SamplingParams
from sonar_core.testing.checkpoints import build_tiny_checkpoint
from sonar_core.testing.losslessness import greedy_outputs, random_prompts
from sonar_core.testing.mtp_layers import build_qwen3_next_target

MAX_TOKENS = 16


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen3_next_target(tmp_path_factory.mktemp("qwen3-next") / "target", num_layers=4)


@pytest.fixture(scope="module")
def llama_draft(hybrid: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer Llama draft with the target's tokenizer and vocabulary."""
    vocab = json.loads((hybrid / "config.json").read_text())["vocab_size"]
    return build_tiny_checkpoint(
        tmp_path_factory.mktemp("qwen3-next-draft"), "llama", num_layers=1, tokenizer=hybrid, vocab_size=vocab
    )


def _prompts() -> list[list[int]]:
    """Random prompts and prompts that repeat themselves (where n-gram drafts get accepted)."""
    repeating = [[11, 12, 13, 14, 15] * 4, [40, 41, 42] * 6 + [40, 41]]
    return random_prompts(5, seed=11, vocab=500, max_len=30) + repeating


@pytest.fixture(scope="module")
def plain(hybrid: Path) -> list[list[int]]:
    return greedy_outputs(hybrid, _prompts(), max_tokens=MAX_TOKENS)[0]


SCRIPTED = str(Path(__file__).with_name("scripted_proposer.py")) + ":ScriptedProposer"


def _scripted(depth: int, plain: list[list[int]]) -> dict:
    """Drafts that verification accepts 0, some and all of, in turn (see scripted_proposer.py)."""
    continuations = [prompt + output for prompt, output in zip(_prompts(), plain, strict=True)]
    return {"method": "custom_class", "custom_class": SCRIPTED, "num_speculative_tokens": depth,
            "options": {"continuations": continuations}}


@pytest.mark.parametrize("depth", [1, 3, 5])
def test_every_accepted_length_commits_the_right_state(hybrid, plain, depth):
    outputs, llm = greedy_outputs(
        hybrid, _prompts(), _scripted(depth, plain), max_tokens=MAX_TOKENS, max_num_seqs=3, max_num_batched_tokens=16
    )
    assert outputs == plain
    stats = llm.engine.spec_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert all(stats.num_accepted_tokens_per_pos)  # every position was accepted at some step
    assert llm.engine.state_cache.num_free_slots == llm.engine.state_cache.num_slots


@pytest.mark.parametrize(
    "speculative",
    [
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3},
        {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1, "depth_policy": "auto"},
        {"method": "draft_model", "num_speculative_tokens": 3},
        {"method": "mtp", "num_speculative_tokens": 1},
        {"method": "mtp", "num_speculative_tokens": 3},
        {"method": "qwen3_next_mtp", "num_speculative_tokens": 2},
    ],
    ids=["ngram-k3", "ngram-k5-auto", "draft_model-k3", "mtp-k1", "mtp-k3", "qwen3_next_mtp-k2"],
)
def test_greedy_output_with_speculation_is_plain_output(hybrid, llama_draft, plain, speculative):
    if speculative["method"] == "draft_model":
        speculative = {**speculative, "model": str(llama_draft)}
    # Three requests a step and 16 tokens a step: prompts are prefilled in chunks, beside decodes.
    outputs, llm = greedy_outputs(
        hybrid, _prompts(), speculative, max_tokens=MAX_TOKENS, max_num_seqs=3, max_num_batched_tokens=16
    )
    assert outputs == plain
    engine = llm.engine
    assert engine.state_cache.num_free_slots == engine.state_cache.num_slots
    assert engine.spec_stats.num_draft_tokens > 0


def test_preemption_and_recompute_restart_the_state(hybrid, plain):
    # Room for about two full requests at a time: later ones preempt earlier ones.
    llm = LLM(model=str(hybrid), dtype="float32", device="cpu", max_num_seqs=6, block_size=4, max_model_len=64,
              kv_cache_memory_gb=_blocks_bytes(hybrid, 28) / 2**30, speculative_config=_scripted(3, plain))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(_prompts(), params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == plain
    engine = llm.engine
    assert engine.num_preemptions > 0
    assert engine.state_cache.num_free_slots == engine.state_cache.num_slots


def test_an_aborted_request_gives_back_its_state_and_disturbs_no_other(hybrid, plain):
    llm = LLM(model=str(hybrid), dtype="float32", device="cpu", max_num_seqs=4, speculative_config=_scripted(3, plain))
    engine = llm.engine
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = _prompts()
    ids = [engine.add_request(prompt, params) for prompt in prompts]
    for _ in range(3):
        engine.step()
    engine.abort_request(ids[1])
    finished: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output.outputs[0].token_ids
    assert ids[1] not in finished
    assert [finished[i] for i in ids if i != ids[1]] == [out for i, out in zip(ids, plain, strict=True) if i != ids[1]]
    assert engine.state_cache.num_free_slots == engine.state_cache.num_slots


def _blocks_bytes(target: Path, num_blocks: int, block_size: int = 4) -> int:
    """Bytes of ``num_blocks`` KV blocks of the target's full-attention layers (float32)."""
    config = json.loads((target / "config.json").read_text())
    full = config["layer_types"].count("full_attention")
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return num_blocks * block_size * full * 2 * config["num_key_value_heads"] * head_dim * 4


def test_a_hybrid_checkpoint_is_refused_as_a_draft_model(hybrid):
    from sonar_core.config import validate_config
    from sonar_core.errors import ConfigError
    from sonar_core.plugins import get_plugin_manager

    speculative = {"method": "draft_model", "model": str(hybrid), "num_speculative_tokens": 2}
    with pytest.raises(ConfigError, match="Qwen3NextForCausalLM.*which method 'draft_model' does not support"):
        validate_config({"model": str(hybrid), "speculative_config": speculative}, get_plugin_manager())


def test_draft_branches_are_refused_on_a_hybrid_target(hybrid):
    """A request has one recurrent state, not one per chain: branches cannot be verified."""
    from sonar_core.errors import ConfigError

    speculative = {"method": "mtp", "num_speculative_tokens": 2, "num_draft_branches": 2}
    with pytest.raises(ConfigError, match="num_draft_branches.*recurrent states"):
        LLM(model=str(hybrid), dtype="float32", device="cpu", speculative_config=speculative)


@pytest.mark.parametrize("method", ["mtp", "qwen3_next_mtp"])
def test_the_guides_mtp_example_at_tiny_scale(hybrid, method):
    params = SamplingParams(temperature=0.0, max_tokens=32)
    prompt = ["Explain continuous batching in two paragraphs."]
    plain = LLM(model=str(hybrid), dtype="float32", device="cpu").generate(prompt, params, use_tqdm=False)
    llm = LLM(model=str(hybrid), dtype="float32", device="cpu",
              speculative_config={"method": method, "num_speculative_tokens": 3})
    outputs = llm.generate(prompt, params, use_tqdm=False)
    assert outputs[0].outputs[0].text == plain[0].outputs[0].text
    assert llm.get_spec_decode_metrics().num_draft_tokens > 0
