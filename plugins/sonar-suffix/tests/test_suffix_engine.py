"""The suffix method inside the engine: lossless greedy output, learning across requests, draft
lengths, and requests that are aborted or preempted."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
from sonar_suffix.proposer import SuffixProposer

from aphrodite import LLM, SamplingParams
from sonar_core.errors import ConfigError
from sonar_core.spec_decode.proposer import DraftProposal, ProposeBatch
from sonar_core.testing.checkpoints import build_tiny_checkpoint

MAX_TOKENS = 32
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("suffix-target"), arch="llama", num_layers=2)


@pytest.fixture(scope="module")
def prompts(model_dir: Path) -> list[list[int]]:
    """Token-id prompts, some with repeated spans (the prompt tree matches them), some without."""
    vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(11)
    prompts = []
    for index in range(6):
        span = [rng.randrange(3, vocab_size) for _ in range(rng.randint(3, 8))]
        noise = [rng.randrange(3, vocab_size) for _ in range(rng.randint(2, 24))]
        prompts.append(noise + span * (index % 3) + span[: index % len(span)])
    return prompts


@pytest.fixture(scope="module")
def reference(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    return generate(make_llm(model_dir, None), prompts)


def make_llm(model_dir: Path, speculative_config: dict | None, **engine_args) -> LLM:
    return LLM(
        model=str(model_dir), dtype="float32", device="cpu", speculative_config=speculative_config, **engine_args
    )


def suffix_config(depth: int, **options) -> dict:
    return {"method": "suffix", "num_speculative_tokens": depth, **options}


def generate(llm: LLM, prompts: list[list[int]], params: SamplingParams = GREEDY) -> list[list[int]]:
    return [list(output.outputs[0].token_ids) for output in llm.generate(prompts, params, use_tqdm=False)]


def suffix_proposer(llm: LLM) -> SuffixProposer:
    proposer = llm.engine.speculator.proposer
    assert isinstance(proposer, SuffixProposer)
    return proposer


def record_drafts(llm: LLM) -> list[tuple[int, int]]:
    """Wrap the proposer's propose: every (max_draft_tokens, draft length) it is asked and answers."""
    proposer = suffix_proposer(llm)
    inner = proposer.propose
    seen: list[tuple[int, int]] = []

    def propose(batch: ProposeBatch) -> DraftProposal:
        proposal = inner(batch)
        seen.extend((r.max_draft_tokens, len(d)) for r, d in zip(batch.requests, proposal.token_ids, strict=True))
        return proposal

    proposer.propose = propose
    return seen


def acceptance(after, before=None) -> tuple[float, int]:
    """Mean acceptance length and accepted tokens between two metric summaries (or since the start)."""
    drafts = after.num_drafts - (before.num_drafts if before else 0)
    accepted = after.num_accepted_tokens - (before.num_accepted_tokens if before else 0)
    return (1.0 + accepted / drafts if drafts else 1.0), accepted


@pytest.mark.parametrize("depth", [1, 8])
def test_greedy_output_equals_output_without_speculation(model_dir, prompts, reference, depth: int) -> None:
    llm = make_llm(model_dir, suffix_config(depth), max_num_seqs=4)
    # The second round drafts from the first round's responses: long drafts, mostly accepted.
    assert generate(llm, prompts) == reference
    assert generate(llm, prompts) == reference
    summary = llm.get_spec_decode_metrics()
    assert summary.num_draft_tokens > 0
    assert summary.num_accepted_tokens > 0
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks
    assert list(suffix_proposer(llm).cache.active_requests) == []


def test_auto_depth_is_lossless(model_dir, prompts, reference) -> None:
    # The whole drafts are cut by auto depth per match length and scored against what followed.
    llm = make_llm(model_dir, {**suffix_config(8), "depth_policy": "auto"}, max_num_seqs=4)
    assert generate(llm, prompts) == reference
    assert generate(llm, prompts) == reference
    assert llm.get_spec_decode_metrics().num_accepted_tokens > 0


def test_a_request_repeating_an_earlier_response_is_drafted_from_the_shared_tree(model_dir, prompts) -> None:
    prompt = [prompts[0]]
    figures = {}
    for cached in (10000, 0):
        llm = make_llm(model_dir, suffix_config(8, suffix_decoding_max_cached_requests=cached))
        first = generate(llm, prompt)
        after_first = llm.get_spec_decode_metrics()
        second = generate(llm, prompt)
        assert first == second
        figures[cached] = (acceptance(after_first), acceptance(llm.get_spec_decode_metrics(), after_first))
    (first_length, first_accepted), (second_length, second_accepted) = figures[10000]
    # The second request's prompt tree holds only the prompt: its long drafts come from the first
    # response, kept in the shared tree, and nearly every output token is drafted and accepted.
    assert second_accepted >= 0.6 * MAX_TOKENS
    assert second_accepted >= first_accepted + 0.5 * MAX_TOKENS
    assert second_length >= 4.0
    assert second_length >= first_length + 2.0
    # Without cached responses the second request drafts exactly as the first did.
    alone_first, alone_second = figures[0]
    assert alone_second == alone_first == (first_length, first_accepted)


def test_draft_lengths_vary_and_never_exceed_num_speculative_tokens(model_dir, prompts) -> None:
    depth = 6
    llm = make_llm(model_dir, suffix_config(depth, suffix_decoding_max_spec_factor=2.0), max_num_seqs=4)
    seen = record_drafts(llm)
    generate(llm, prompts)
    generate(llm, prompts)
    assert seen
    assert all(length <= budget <= depth for budget, length in seen)
    lengths = {length for _, length in seen}
    # Dynamic: no draft, short drafts and full-length drafts all occur.
    assert 0 in lengths
    assert depth in lengths
    assert lengths & set(range(1, depth))


def test_an_aborted_request_leaves_no_active_state_and_its_id_can_be_reused(model_dir, prompts, reference) -> None:
    llm = make_llm(model_dir, suffix_config(4))
    engine = llm.engine
    proposer = suffix_proposer(llm)
    ids = [engine.add_request(prompt, GREEDY, request_id=f"r{i}") for i, prompt in enumerate(prompts[:3])]
    for _ in range(4):
        engine.step()
    assert set(proposer.cache.active_requests) == set(ids)
    engine.abort_request("r1")
    assert set(proposer.cache.active_requests) == {"r0", "r2"}
    # Its partial response is evicted: no later request drafts from an incomplete output.
    assert "r1" not in proposer.cache.cached_requests
    # The same id again: a fresh request whose drafts do not depend on the aborted one's state.
    engine.add_request(prompts[3], GREEDY, request_id="r1")
    finished = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = list(output.outputs[0].token_ids)
    assert finished == {"r0": reference[0], "r1": reference[3], "r2": reference[2]}
    assert list(proposer.cache.active_requests) == []
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def test_preempted_requests_resume_losslessly_and_leave_no_state(model_dir, prompts, reference) -> None:
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config["hidden_size"] // config["num_attention_heads"]
    block_size = 16
    bytes_per_block = 2 * block_size * config["num_key_value_heads"] * head_dim * 4 * config["num_hidden_layers"]
    # Room for one full-length request and a little more: the batch must preempt to make progress.
    max_model_len = 128
    num_blocks = max_model_len // block_size + 4
    llm = make_llm(
        model_dir,
        suffix_config(4),
        max_model_len=max_model_len,
        block_size=block_size,
        kv_cache_memory_gb=num_blocks * bytes_per_block / (1 << 30),
    )
    proposer = suffix_proposer(llm)
    starts: dict[str, int] = {}
    inner_add = proposer.add_request

    def add_request(request_id: str, prompt_token_ids: list[int]) -> None:
        starts[request_id] = starts.get(request_id, 0) + 1
        inner_add(request_id, prompt_token_ids)

    proposer.add_request = add_request
    assert generate(llm, prompts) == reference
    assert max(starts.values()) > 1, "no request was preempted and resumed"
    assert list(proposer.cache.active_requests) == []
    # Each finished response is cached once, under its own id, however often it was preempted.
    assert sorted(proposer.cache.cached_requests) == sorted(starts)


def test_choosing_suffix_without_arctic_inference_fails_at_startup_with_the_install_command(
    model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "arctic_inference", None)
    monkeypatch.setitem(sys.modules, "arctic_inference.suffix_decoding", None)
    with pytest.raises(ConfigError) as raised:
        make_llm(model_dir, suffix_config(4))
    assert raised.value.field == "speculative_config.method"
    assert "pip install -e plugins/sonar-suffix" in raised.value.fix
