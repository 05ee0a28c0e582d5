"""Greedy output with speculation equals greedy output without it, token for token (float32)."""

import random
from pathlib import Path

import pytest

from aphrodite import LLM, SamplingParams

NUM_PROMPTS = 20
MAX_TOKENS = 24
CUSTOM_PROPOSER = Path(__file__).resolve().parents[2] / "examples" / "custom_proposer.py"


def _prompts(vocab_size: int) -> list[list[int]]:
    """Token-id prompts with repeated spans, so that prompt lookup finds matches."""
    rng = random.Random(7)
    prompts = []
    for i in range(NUM_PROMPTS):
        span = [rng.randrange(3, vocab_size) for _ in range(rng.randint(3, 8))]
        noise = [rng.randrange(3, vocab_size) for _ in range(rng.randint(1, 20))]
        prompts.append(noise + span * rng.randint(1, 4) + span[: i % len(span)])
    # Runs of one token, for proposers that extend runs.
    prompts[::5] = [p + [p[-1]] * 6 for p in prompts[::5]]
    return prompts


def _generate(model: Path, speculative_config, prompts, batch_size: int):
    llm = LLM(
        model=str(model),
        dtype="float32",
        device="cpu",
        max_num_seqs=batch_size,
        speculative_config=speculative_config,
    )
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks  # nothing leaked
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.fixture(scope="module")
def prompts(target_dir: Path) -> list[list[int]]:
    from transformers import AutoConfig

    return _prompts(AutoConfig.from_pretrained(target_dir).vocab_size)


@pytest.fixture(scope="module")
def reference(target_dir: Path, prompts) -> list[list[int]]:
    tokens, _ = _generate(target_dir, None, prompts, batch_size=8)
    return tokens


def _method_config(method: str, depth: int, draft_dir: Path) -> dict:
    if method == "draft_model":
        return {"method": method, "model": str(draft_dir), "num_speculative_tokens": depth}
    if method.startswith("ngram"):
        return {"method": method, "num_speculative_tokens": depth, "prompt_lookup_min": 1,
                "prompt_lookup_max": 4}
    if method == "custom_class":
        return {"method": method, "custom_class": f"{CUSTOM_PROPOSER}:RepeatRunProposer",
                "num_speculative_tokens": depth, "options": {"min_run": 2}}
    raise AssertionError(method)


@pytest.mark.parametrize("method", ["ngram", "ngram_gpu", "draft_model", "custom_class"])
@pytest.mark.parametrize("batch_size", [1, 8])
@pytest.mark.parametrize("depth", [1, 3, 7])
def test_greedy_speculation_is_lossless(method, batch_size, depth, target_dir, draft_dir, prompts, reference):
    tokens, llm = _generate(target_dir, _method_config(method, depth, draft_dir), prompts, batch_size)
    assert tokens == reference
    summary = llm.get_spec_decode_metrics()
    # Speculation really happened: drafts were proposed (and, for the general methods, accepted).
    assert summary.num_draft_tokens > 0
    if method != "custom_class":
        assert summary.num_accepted_tokens > 0


@pytest.mark.parametrize("method", ["ngram", "ngram_gpu", "draft_model"])
@pytest.mark.parametrize("batch_size", [1, 8])
def test_auto_depth_is_lossless(method, batch_size, target_dir, draft_dir, prompts, reference):
    # The lookups draft whole budgets that auto depth cuts; the draft model drafts what it chose.
    config = {**_method_config(method, 5, draft_dir), "depth_policy": "auto"}
    tokens, llm = _generate(target_dir, config, prompts, batch_size)
    assert tokens == reference
    assert llm.get_spec_decode_metrics().num_draft_tokens > 0
