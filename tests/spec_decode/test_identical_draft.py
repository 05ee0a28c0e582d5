"""A draft identical to the target must be accepted at every position.

This catches off-by-one errors in positions, KV slots and hidden-state alignment that equality
tests can miss: any misalignment makes the draft disagree with the target somewhere.
"""

from pathlib import Path

import pytest

from aphrodite import LLM, SamplingParams

DEPTH = 4


@pytest.mark.parametrize(
    ("draft_sample_method", "temperature"),
    [("greedy", 0.0), ("probabilistic", 0.0), ("probabilistic", 1.0)],
)
def test_identical_draft_is_always_accepted(target_dir: Path, draft_sample_method, temperature):
    llm = LLM(
        model=str(target_dir),
        dtype="float32",
        device="cpu",
        speculative_config={
            "method": "draft_model",
            "model": str(target_dir),
            "num_speculative_tokens": DEPTH,
            "draft_sample_method": draft_sample_method,
        },
    )
    prompts = [[5, 9, 12, 40, 7], [100, 3, 3, 8], list(range(20, 60))]
    params = SamplingParams(temperature=temperature, seed=3, max_tokens=1 + 6 * (DEPTH + 1), ignore_eos=True)
    # After the first token each step drafts DEPTH tokens and emits DEPTH + 1, never clipped.
    llm.generate(prompts, params, use_tqdm=False)
    summary = llm.get_spec_decode_metrics()
    assert summary.num_drafts > 0
    assert summary.num_accepted_tokens == summary.num_draft_tokens
    assert summary.per_position_acceptance_rate == [1.0] * DEPTH
    assert summary.mean_acceptance_length == pytest.approx(DEPTH + 1)
