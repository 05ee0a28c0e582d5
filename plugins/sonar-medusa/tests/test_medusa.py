"""Medusa: lossless over layouts, batches, depths, chunked prefill and preemption; drafts equal the
published forward; probabilistic drafting follows the target; every bad checkpoint is one error."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sonar_core.errors import ConfigError
from sonar_core.testing.losslessness import (
    assert_follows_target_distribution,
    constant_distribution_target,
    greedy_outputs,
    per_position_acceptance,
    probabilistic_llm,
    random_prompts,
    sampled_output_distances,
)
from sonar_core.testing.medusa_heads import build_medusa_head
from sonar_core.testing.plugin_checks import check_drafts, validate_for_target

LAYOUTS = {
    "vllm": dict(layout="vllm", num_heads=4),
    "vllm-truncated-vocab-two-layers": dict(layout="vllm", num_heads=3, num_layers=2, truncated_vocab_size=200),
    "fasterdecoding": dict(layout="fasterdecoding", num_heads=3, config_num_heads=2),
}


def _prompts() -> list[list[int]]:
    return random_prompts(8, seed=5)


@pytest.fixture(scope="module")
def reference(target: Path) -> list[list[int]]:
    return greedy_outputs(target, _prompts(), max_num_seqs=8)[0]


def _config(heads: Path, depth: int, **extra) -> dict:
    return {"method": "medusa", "model": str(heads), "num_speculative_tokens": depth, **extra}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(("batch", "depth"), [(1, 1), (8, 3)])
def test_greedy_output_equals_plain_output(layout, batch, depth, target, make_heads, reference):
    heads = make_heads(target, **LAYOUTS[layout])
    tokens, llm = greedy_outputs(target, _prompts(), _config(heads, depth), max_num_seqs=batch)
    assert tokens == reference
    assert llm.get_spec_decode_metrics().num_draft_tokens > 0


def test_chunked_prefill_and_preemption_keep_greedy_output(target, make_heads, reference):
    heads = make_heads(target, **LAYOUTS["vllm"])
    assert greedy_outputs(target, _prompts(), _config(heads, 4), max_num_seqs=4, max_num_batched_tokens=8)[0] == reference
    # 24 blocks of 4 tokens (2 layers, K and V, 2 heads x 16 dims, fp32: 2048 bytes a block).
    tokens, llm = greedy_outputs(
        target, _prompts(), _config(heads, 4), max_num_seqs=8, block_size=4, max_model_len=64,
        kv_cache_memory_gb=24 * 2048 / 2**30,
    )
    assert tokens == reference
    assert llm.engine.num_preemptions > 0


def _reference_drafts(heads_dir: Path, layout: str, state: torch.Tensor, depth: int) -> list[int]:
    """The published forward: each head's ResBlocks on the final state, then its own LM head."""
    if layout == "fasterdecoding":
        weights = torch.load(heads_dir / "medusa_lm_head.pt", weights_only=True)
        layers = json.loads((heads_dir / "config.json").read_text())["medusa_num_layers"]

        def block(h, layer):
            return weights[f"{h}.{layer}.linear.weight"], weights[f"{h}.{layer}.linear.bias"]

        def lm(h):
            return weights[f"{h}.{layers}.weight"]
        token_map = None
    else:
        weights = load_file(heads_dir / "model.safetensors")
        layers = json.loads((heads_dir / "config.json").read_text())["num_hidden_layers"]

        def block(h, layer):
            return weights[f"blocks.{h}.layers.{layer}.weight"], weights.get(f"blocks.{h}.layers.{layer}.bias")

        def lm(h):
            return weights[f"lm_heads.{h}.weight"]
        token_map = weights.get("token_map")
    drafts = []
    for h in range(depth):
        x = state
        for layer in range(layers):
            weight, bias = block(h, layer)
            y = x @ weight.T + (bias if bias is not None else 0)
            x = x + torch.nn.functional.silu(y)
        draft = int((x @ lm(h).T).argmax())
        drafts.append(int(token_map[draft]) if token_map is not None else draft)
    return drafts


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_drafts_equal_the_published_forward(layout, target, make_heads):
    from aphrodite import LLM

    options = LAYOUTS[layout]
    heads = make_heads(target, **options)
    llm = LLM(model=str(target), dtype="float32", device="cpu",
              speculative_config=_config(heads, options["num_heads"]), max_num_batched_tokens=16, max_num_seqs=4)

    def expected(batch, request):
        state = batch.target_hidden.final[request.hidden_rows.stop - 1]
        return _reference_drafts(heads, options["layout"], state, request.max_draft_tokens)

    assert check_drafts(llm, _prompts(), expected) > 20


def _matching_heads(target: Path, out: Path, noise: float) -> Path:
    """Heads whose ResBlocks add nothing and whose LM heads are the target's (plus noise)."""
    build_medusa_head(target, out, layout="vllm", num_heads=3)
    weights = load_file(out / "model.safetensors")
    lm_head = load_file(target / "model.safetensors")["lm_head.weight"]
    generator = torch.Generator().manual_seed(9)
    for name in list(weights):
        if name.startswith("blocks."):
            weights[name] = torch.zeros_like(weights[name])
        if name.startswith("lm_heads."):
            weights[name] = lm_head + noise * torch.randn(lm_head.shape, generator=generator)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def constant_target(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return constant_distribution_target(target, tmp_path_factory.mktemp("medusa-constant"))


def test_heads_drafting_the_targets_distribution_are_always_accepted(constant_target, tmp_path):
    llm = probabilistic_llm(constant_target, _config(_matching_heads(constant_target, tmp_path / "heads", 0.0), 3))
    assert per_position_acceptance(llm, depth=3) == [1.0, 1.0, 1.0]


def test_sampled_output_follows_the_target_distribution(constant_target, tmp_path):
    llm = probabilistic_llm(constant_target, _config(_matching_heads(constant_target, tmp_path / "heads", 0.05), 2))
    results = sampled_output_distances(llm)
    assert 0.2 < llm.get_spec_decode_metrics().acceptance_rate < 0.9
    assert_follows_target_distribution(results)


# --- configuration ------------------------------------------------------------------------------


def _check(target: Path, **fields):
    return validate_for_target(target, "medusa", method="medusa", **fields)


def test_heads_are_counted_from_the_weights(target, make_heads):
    heads = make_heads(target, **LAYOUTS["fasterdecoding"])  # its config says 2, its weights hold 3
    assert _check(target, model=str(heads)).num_speculative_tokens == 3


def test_more_drafts_than_heads_is_refused(target, make_heads):
    heads = make_heads(target, **LAYOUTS["fasterdecoding"])
    with pytest.raises(ConfigError) as info:
        _check(target, model=str(heads), num_speculative_tokens=4)
    assert info.value.field == "speculative_config.num_speculative_tokens"
    assert "has 3 heads" in info.value.message and "at most 3" in info.value.fix


def test_a_missing_head_tensor_is_named(target, make_heads, tmp_path):
    folder = tmp_path / "heads"
    shutil.copytree(make_heads(target, **LAYOUTS["vllm"]), folder)
    weights = load_file(folder / "model.safetensors")
    del weights["blocks.2.layers.0.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"missing \(1\): blocks.2.layers.0.weight"):
        _check(target, model=str(folder), num_speculative_tokens=2)


def test_heads_of_another_hidden_size_are_refused(target, tmp_path):
    wider = build_tiny_checkpoint_wider(tmp_path)
    heads = build_medusa_head(wider, tmp_path / "heads", layout="fasterdecoding")
    with pytest.raises(ConfigError, match=r"of the wrong shape .*0.0.linear.weight \[96, 96\] \(expected \[64, 64\]\)"):
        _check(target, model=str(heads), num_speculative_tokens=2)


def build_tiny_checkpoint_wider(tmp_path: Path) -> Path:
    from sonar_core.testing.checkpoints import build_tiny_checkpoint

    return build_tiny_checkpoint(tmp_path / "wide", arch="llama", num_layers=1, hidden_size=96)


def test_a_truncated_vocabulary_needs_its_token_map(target, make_heads, tmp_path):
    folder = tmp_path / "heads"
    shutil.copytree(make_heads(target, **LAYOUTS["vllm-truncated-vocab-two-layers"]), folder)
    weights = load_file(folder / "model.safetensors")
    del weights["token_map"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match="has no token_map"):
        _check(target, model=str(folder), num_speculative_tokens=2)


def test_medusa_needs_heads(target):
    with pytest.raises(ConfigError, match="drafts with trained Medusa heads, and none was given"):
        _check(target, num_speculative_tokens=2)
