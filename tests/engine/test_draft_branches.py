"""Draft branches: a request's chain and its alternatives, each in a KV fork, verified side by side.

A scripted proposer (scripted_proposer.py) puts the right continuation in the request's own chain,
in one of its branches or in none, in turn, with a wrong draft at a varying depth: greedy output
must equal plain output token for token whichever chain wins and however much of it is accepted,
with chunked prefill, preemption, aborts and the prefix cache, and every KV block must come back.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aphrodite import LLM, SamplingParams
from sonar_core.engine import speculator as speculator_module
from sonar_core.engine import verifier as verifier_module
from sonar_core.engine.kv_budget import bytes_per_block
from sonar_core.engine.speculator import DraftBranching
from sonar_core.errors import ConfigError
from sonar_core.kv import KVLayerSpec
from sonar_core.testing.branches import branch_on_every_step
from sonar_core.testing.checkpoints import build_tiny_checkpoint
from sonar_core.testing.losslessness import greedy_outputs, outputs_with_aborts, random_prompts

BRANCHING = str(Path(__file__).with_name("scripted_proposer.py")) + ":BranchingScriptedProposer"
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("branches"), "llama", num_layers=2)


def _prompts() -> list[list[int]]:
    return random_prompts(6, seed=3, vocab=500, max_len=30)


@pytest.fixture(scope="module")
def plain(target: Path) -> list[list[int]]:
    return greedy_outputs(target, _prompts(), max_tokens=MAX_TOKENS)[0]


def _config(plain: list[list[int]], depth: int, branches: int) -> dict:
    continuations = [prompt + output for prompt, output in zip(_prompts(), plain, strict=True)]
    return {"method": "custom_class", "custom_class": BRANCHING, "num_speculative_tokens": depth,
            "num_draft_branches": branches + 1, "options": {"continuations": continuations, "branches": branches}}


def _unset_branches_config(plain: list[list[int]]) -> dict:
    """The scripted proposer at depth 3 with two branches of its own, num_draft_branches unset."""
    config = _config(plain, 3, 2)
    del config["num_draft_branches"]
    return config


@pytest.fixture
def any_step_size(monkeypatch: pytest.MonkeyPatch) -> None:
    """Branches for every drafting request however many rows the step verifies."""
    branch_on_every_step(monkeypatch)


@pytest.fixture
def winners(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Every verified request's winning chain (0: its own, b: branch b - 1), as steps go."""
    seen: list[int] = []
    call = verifier_module.Verifier.__call__

    def recording(self, run, scheduled):
        result = call(self, run, scheduled)
        seen.extend(w for w, item in zip(result.winners, scheduled, strict=True) if item.draft_branches)
        return result

    monkeypatch.setattr(verifier_module.Verifier, "__call__", recording)
    return seen


@pytest.mark.parametrize(("depth", "branches", "batch"), [(1, 1, 1), (3, 2, 4), (5, 2, 6), (4, 3, 3)])
def test_greedy_output_equals_plain_whichever_chain_wins(
    target, plain, winners, any_step_size, depth, branches, batch
):
    outputs, llm = greedy_outputs(
        target, _prompts(), _config(plain, depth, branches), max_tokens=MAX_TOKENS, max_num_seqs=batch, block_size=4
    )
    assert outputs == plain
    assert set(winners) == set(range(branches + 1)), "every chain won some step"
    stats = llm.engine.spec_stats
    assert all(stats.num_accepted_tokens_per_pos)


def test_branches_that_do_not_fit_the_step_are_left_out(target, plain, any_step_size):
    """A step of 8 tokens cannot take a request's drafts and its branches: chunked prefill and
    partial steps verify the request's own chain only, and the output stays the same."""
    outputs, _ = greedy_outputs(
        target, _prompts(), _config(plain, 3, 2), max_tokens=MAX_TOKENS, max_num_seqs=4, max_num_batched_tokens=8
    )
    assert outputs == plain


def test_preemption_frees_the_forks_and_keeps_the_output(target, plain, any_step_size):
    # Two layers of 2 KV heads x 16 dims (the tiny target), fp32, blocks of 4 tokens: 24 blocks
    # hold about two requests, so later ones preempt earlier ones.
    per_block = bytes_per_block([KVLayerSpec(2, 16)] * 2, 4, torch.float32)
    outputs, llm = greedy_outputs(
        target, _prompts(), _config(plain, 4, 2), max_tokens=MAX_TOKENS, max_num_seqs=6, block_size=4,
        max_model_len=64, kv_cache_memory_gb=24 * per_block / 2**30,
    )
    assert outputs == plain
    assert llm.engine.num_preemptions > 0


def test_aborted_requests_free_their_forks(target, plain, any_step_size):
    llm = LLM(model=str(target), dtype="float32", device="cpu", block_size=4,
              speculative_config=_config(plain, 3, 2))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    aborted = set(range(0, len(plain), 2))
    finished, all_freed = outputs_with_aborts(llm.engine, _prompts(), params, aborted, abort_at_step=2)
    assert finished == {i: plain[i] for i in range(len(plain)) if i not in aborted}
    assert all_freed


def test_branches_go_to_the_first_requests_while_the_step_stays_small(target, plain, monkeypatch):
    """Two requests of 3 drafts verify 8 rows; 16 leave room for the first one's two branches
    (two drafts each, one fewer than its own chain: three rows), not for the second one's."""
    steps: list[tuple[int, int]] = []  # per step with branches: (verified rows, requests with branches)
    call = verifier_module.Verifier.__call__

    def recording(self, run, scheduled):
        drafting = [item for item in scheduled if item.draft_token_ids]
        if any(item.draft_branches for item in drafting):
            steps.append((sum(item.num_rows for item in drafting), sum(bool(item.draft_branches) for item in drafting)))
        return call(self, run, scheduled)

    monkeypatch.setattr(verifier_module.Verifier, "__call__", recording)
    prompts = _prompts()[:2]
    outputs, _ = greedy_outputs(
        target, prompts, _config(plain, 3, 2), max_tokens=MAX_TOKENS, max_num_seqs=2, block_size=4
    )
    assert outputs == plain[:2]
    assert steps and all(rows <= speculator_module.BRANCH_ROW_LIMIT for rows, _ in steps)
    assert (14, 1) in steps


def test_logprobs_come_from_the_winning_chain(target, plain, any_step_size):
    prompts = _prompts()[:3]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    reference = LLM(model=str(target), dtype="float32", device="cpu").generate(prompts, params, use_tqdm=False)
    llm = LLM(model=str(target), dtype="float32", device="cpu", block_size=4, speculative_config=_config(plain, 3, 2))
    outputs = llm.generate(prompts, params, use_tqdm=False)
    for got, want in zip(outputs, reference, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].logprobs == pytest.approx(want.outputs[0].logprobs, abs=1e-4)


@pytest.mark.parametrize("branches", [0, -1])
def test_a_branch_count_below_one_names_the_field(target, branches):
    with pytest.raises(ConfigError, match="num_draft_branches"):
        LLM(model=str(target), device="cpu",
            speculative_config={"method": "ngram", "num_speculative_tokens": 3, "num_draft_branches": branches})


def test_a_method_without_branches_is_warned_and_drafts_chains(target):
    from sonar_core.config import validate_config
    from sonar_core.plugins import get_plugin_manager

    speculative = {"method": "ngram", "num_speculative_tokens": 3, "num_draft_branches": 2}
    resolved = validate_config({"model": str(target), "speculative_config": speculative}, get_plugin_manager())
    assert any("num_draft_branches has no effect with method 'ngram'" in w and "eagle3" in w for w in resolved.warnings)
    llm = LLM(model=str(target), device="cpu", speculative_config=speculative)
    assert llm.engine.speculator.num_draft_branches == 1


def test_a_proposer_that_drafts_no_branches_refuses_them(target, plain):
    """custom_class reads every field: its class must declare the branches it drafts."""
    config = {**_config(plain, 3, 2), "custom_class": str(Path(__file__).with_name("scripted_proposer.py"))
              + ":ScriptedProposer", "options": {"continuations": [[1, 2]]}}
    with pytest.raises(ConfigError, match="num_draft_branches.*max_draft_branches"):
        LLM(model=str(target), device="cpu", speculative_config=config)


def test_branches_without_amx_tiles_say_what_they_cost(target, plain, caplog):
    """Float32 never takes the AMX path: extra rows cost there, and the engine says so."""
    with caplog.at_level("WARNING", logger="sonar.engine"):
        LLM(model=str(target), dtype="float32", device="cpu", speculative_config=_config(plain, 3, 2))
    assert "num_draft_branches=3" in caplog.text and "not AMX" in caplog.text


@pytest.mark.parametrize(
    ("configured", "proposer_branches", "device", "dtype", "forkable", "cheap_rows", "expected"),
    [
        (None, True, "cpu", torch.bfloat16, True, True, DraftBranching(3, only_alone=True)),
        (None, True, "cpu", torch.bfloat16, True, False, DraftBranching()),  # rows cost their multiply-adds
        (None, True, "cuda", torch.bfloat16, True, True, DraftBranching()),  # not measured on accelerators
        (None, False, "cpu", torch.bfloat16, True, True, DraftBranching()),  # a proposer that drafts chains
        (None, True, "cpu", torch.bfloat16, False, True, DraftBranching()),  # recurrent states or ranks
        (2, True, "cpu", torch.float32, True, False, DraftBranching(2)),  # as asked, in every step
        (1, True, "cpu", torch.bfloat16, True, True, DraftBranching()),
    ],
)
def test_unset_branches_follow_what_a_verified_row_costs(
    monkeypatch, configured, proposer_branches, device, dtype, forkable, cheap_rows, expected
):
    monkeypatch.setattr(speculator_module, "extra_rows_cost_little", lambda *_: cheap_rows)
    branching = speculator_module.DraftBranching.of(configured, proposer_branches, torch.device(device), dtype, forkable)
    assert branching == expected


def test_unset_branches_go_to_a_request_drafting_alone(target, plain, monkeypatch):
    """Where verified rows cost little, a request drafting alone in its step gets the unset
    default's branches and one drafting beside another drafts its chain alone."""
    monkeypatch.setattr(speculator_module, "extra_rows_cost_little", lambda *_: True)
    steps: list[tuple[int, int]] = []  # per step: (drafting requests, requests with branches)
    call = verifier_module.Verifier.__call__

    def recording(self, run, scheduled):
        drafting = [item for item in scheduled if item.draft_token_ids]
        steps.append((len(drafting), sum(bool(item.draft_branches) for item in drafting)))
        return call(self, run, scheduled)

    monkeypatch.setattr(verifier_module.Verifier, "__call__", recording)
    config = _unset_branches_config(plain)
    prompts = _prompts()[:2]
    # The second request asks for fewer tokens, so the first drafts alone once it is done.
    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS // 3, ignore_eos=True)]
    llm = LLM(model=str(target), dtype="float32", device="cpu", block_size=4, max_num_seqs=2,
              speculative_config=config)
    assert llm.engine.speculator.num_draft_branches == speculator_module.AUTO_DRAFT_BRANCHES
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == [plain[0], plain[1][: MAX_TOKENS // 3]]
    assert (1, 1) in steps, "a request drafting alone got branches"
    assert any(drafting == 2 for drafting, _ in steps)
    assert all(with_branches == 0 for drafting, with_branches in steps if drafting > 1)


def test_unset_branches_draft_one_chain_where_rows_cost(target, plain):
    """Float32 never takes the AMX path: unset, every request drafts its chain alone, unwarned."""
    config = _unset_branches_config(plain)
    llm = LLM(model=str(target), dtype="float32", device="cpu", speculative_config=config)
    assert llm.engine.speculator.num_draft_branches == 1
