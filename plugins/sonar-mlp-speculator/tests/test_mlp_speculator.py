"""The MLP speculator: lossless over layouts, batches, depths, chunked prefill and preemption; drafts
equal the published forward; probabilistic drafting follows the target; every bad checkpoint or
depth is one error."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sonar_core.errors import ConfigError
from sonar_core.testing.checkpoints import build_tiny_checkpoint
from sonar_core.testing.losslessness import (
    assert_follows_target_distribution,
    constant_distribution_target,
    greedy_outputs,
    per_position_acceptance,
    probabilistic_llm,
    random_prompts,
    sampled_output_distances,
    target_logits,
)
from sonar_core.testing.medusa_heads import build_mlp_speculator
from sonar_core.testing.plugin_checks import check_drafts, validate_for_target

VARIANTS = {
    "untied": dict(n_predict=3),
    "inner-dim-scale-input": dict(n_predict=3, inner_dim=48, scale_input=True),
    "tied": dict(n_predict=2, tie_weights=True),
    "tied-with-copies-no-prefix": dict(n_predict=3, tie_weights=True, write_tied_copies=True, prefix=""),
}


@pytest.fixture(scope="session")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("mlp-target"), arch="qwen2", num_layers=2)


@pytest.fixture(scope="session")
def speculators(target: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("mlp-speculators")
    return {name: build_mlp_speculator(target, root / name, **options) for name, options in VARIANTS.items()}


def _depth(variant: str) -> int:
    """n_predict, or two rounds of it for tied stages."""
    options = VARIANTS[variant]
    return options["n_predict"] * (2 if options.get("tie_weights") else 1)


def _prompts() -> list[list[int]]:
    return random_prompts(8, seed=8)


@pytest.fixture(scope="module")
def reference(target: Path) -> list[list[int]]:
    return greedy_outputs(target, _prompts(), max_num_seqs=8)[0]


def _config(model: Path, depth: int, **extra) -> dict:
    return {"method": "mlp_speculator", "model": str(model), "num_speculative_tokens": depth, **extra}


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_output_equals_plain_output(variant, batch, target, speculators, reference):
    depth = _depth(variant)
    tokens, llm = greedy_outputs(target, _prompts(), _config(speculators[variant], depth), max_num_seqs=batch)
    assert tokens == reference
    assert llm.get_spec_decode_metrics().num_draft_tokens > 0


def test_chunked_prefill_and_preemption_keep_greedy_output(target, speculators, reference):
    config = _config(speculators["untied"], 3)
    assert greedy_outputs(target, _prompts(), config, max_num_seqs=4, max_num_batched_tokens=8)[0] == reference
    tokens, llm = greedy_outputs(
        target, _prompts(), config, max_num_seqs=8, block_size=4, max_model_len=64, kv_cache_memory_gb=24 * 2048 / 2**30,
    )
    assert tokens == reference
    assert llm.engine.num_preemptions > 0


class Reference:
    """fms-extras' MLPSpeculator forward, written from the published layout."""

    def __init__(self, folder: Path) -> None:
        self.config = json.loads((folder / "config.json").read_text())
        self.w = {k.removeprefix("speculator."): v for k, v in load_file(folder / "model.safetensors").items()}
        n = self.config["n_predict"]
        inner = self.config["inner_dim"] or self.config["emb_dim"]
        self.state_weight = 0.5 ** (0.5 / n)
        self.emb_weight = math.sqrt((1 - self.state_weight**2) * (inner / 2))

    def _index(self, kind: str, stage: int) -> int:
        if not self.config["tie_weights"]:
            return stage
        return min(stage, 1) if kind == "proj" else 0

    def first_state(self, state: torch.Tensor) -> torch.Tensor:
        if self.config["scale_input"]:
            state = state * torch.rsqrt(state.pow(2).mean(-1, keepdim=True) + 1e-6) / math.sqrt(2)
        return state

    def stage(self, i: int, state: torch.Tensor, token: int) -> tuple[torch.Tensor, torch.Tensor]:
        w = self.w
        out = state @ w[f"proj.{self._index('proj', i)}.weight"].T
        out = out + w[f"emb.{self._index('emb', i)}.weight"][token] * (self.emb_weight / self.state_weight)
        ln = self._index("ln", i)
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + 1e-6)
        state = torch.nn.functional.gelu(w[f"ln.{ln}.weight"] * normed + w[f"ln.{ln}.bias"])
        return state, state @ w[f"head.{self._index('head', i)}.weight"].T

    def drafts(self, state: torch.Tensor, token: int, depth: int) -> list[int]:
        state, drafts = self.first_state(state), []
        for i in range(depth):
            state, logits = self.stage(i, state, token)
            token = int(logits.argmax())
            drafts.append(token)
        return drafts


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_drafts_equal_the_published_forward(variant, target, speculators):
    from aphrodite import LLM

    llm = LLM(model=str(target), dtype="float32", device="cpu",
              speculative_config=_config(speculators[variant], _depth(variant)), max_num_batched_tokens=16, max_num_seqs=4)
    reference = Reference(speculators[variant])

    def expected(batch, request):
        state = batch.target_hidden.final[request.hidden_rows.stop - 1]
        return reference.drafts(state, request.token_ids[-1], request.max_draft_tokens)

    assert check_drafts(llm, _prompts(), expected) > 20


def _matching_speculator(target: Path, out: Path, noise: float) -> Path:
    """Stages that ignore the token and whose heads reproduce the target's (constant) logits."""
    from aphrodite import LLM

    build_mlp_speculator(target, out, n_predict=2)
    weights = load_file(out / "model.safetensors")
    for name in list(weights):
        if ".emb." in f".{name}":
            weights[name] = torch.zeros_like(weights[name])
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    llm = LLM(model=str(target), dtype="float32", device="cpu")
    logits = target_logits(llm)
    model = llm.engine.model
    with torch.inference_mode():
        state = model.model.norm(model.model.embed_tokens.weight[:1])[0]
    reference = Reference(out)
    state = reference.first_state(state)
    generator = torch.Generator().manual_seed(4)
    for i in range(2):
        state, _ = reference.stage(i, state, 0)
        head = torch.outer(logits, state) / state.dot(state)
        weights[f"speculator.head.{i}.weight"] = head + noise * torch.randn(head.shape, generator=generator)
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


@pytest.fixture(scope="module")
def constant_target(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return constant_distribution_target(target, tmp_path_factory.mktemp("mlp-constant"))


def test_stages_drafting_the_targets_distribution_are_always_accepted(constant_target, tmp_path):
    speculator = _matching_speculator(constant_target, tmp_path / "mlp", 0.0)
    assert per_position_acceptance(probabilistic_llm(constant_target, _config(speculator, 2)), depth=2) == [1.0, 1.0]


def test_sampled_output_follows_the_target_distribution(constant_target, tmp_path):
    llm = probabilistic_llm(constant_target, _config(_matching_speculator(constant_target, tmp_path / "mlp", 0.4), 2))
    results = sampled_output_distances(llm)
    assert 0.2 < llm.get_spec_decode_metrics().acceptance_rate < 0.9
    assert_follows_target_distribution(results)


# --- configuration ------------------------------------------------------------------------------


def _check(target: Path, **fields):
    return validate_for_target(target, "mlp_speculator", method="mlp_speculator", **fields)


def test_the_depth_defaults_to_n_predict_and_is_detected(target, speculators):
    resolved = _check(target, model=str(speculators["untied"]))
    assert resolved.num_speculative_tokens == 3
    assert validate_for_target(target, "mlp_speculator", model=str(speculators["untied"])).method == "mlp_speculator"


@pytest.mark.parametrize(
    ("variant", "depth", "message"),
    [
        ("untied", 4, "has n_predict=3 stages with their own weights"),
        ("tied-with-copies-no-prefix", 4, "is not a multiple of it"),
    ],
)
def test_depths_the_stages_cannot_serve_are_refused(target, speculators, variant, depth, message):
    with pytest.raises(ConfigError) as info:
        _check(target, model=str(speculators[variant]), num_speculative_tokens=depth)
    assert info.value.field == "speculative_config.num_speculative_tokens" and message in info.value.message


def test_tied_stages_repeat_in_rounds_of_n_predict(target, speculators):
    assert _check(target, model=str(speculators["tied"]), num_speculative_tokens=6).num_speculative_tokens == 6


def test_a_missing_stage_and_another_hidden_size_are_named(target, speculators, tmp_path):
    folder = tmp_path / "spec"
    shutil.copytree(speculators["untied"], folder)
    weights = load_file(folder / "model.safetensors")
    del weights["speculator.head.2.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"missing \(1\): head.2.weight"):
        _check(target, model=str(folder))
    wider = build_tiny_checkpoint(tmp_path / "wide", arch="qwen2", num_layers=1, hidden_size=96)
    with pytest.raises(ConfigError, match="emb_dim=96, but the target's hidden size is 64"):
        _check(target, model=str(build_mlp_speculator(wider, tmp_path / "wide-spec")))
