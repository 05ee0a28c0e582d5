"""MTP from the target checkpoint (MiMo layout): lossless over batches, depths, chunked prefill and
preemption; drafts equal a reference forward written here from FORMATS.md 5.2; probabilistic
drafting follows the target distribution; every startup check and the old method names."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from aphrodite import LLM
from sonar_core.errors import ConfigError
from sonar_core.testing.branches import branch_on_every_step
from sonar_core.testing.checkpoints import build_tiny_checkpoint
from sonar_core.testing.losslessness import (
    assert_follows_target_distribution,
    constant_distribution_target,
    greedy_outputs,
    per_position_acceptance,
    probabilistic_llm,
    random_prompts,
    sampled_output_distances,
)
from sonar_core.testing.mtp_layers import build_mimo_target
from sonar_core.testing.plugin_checks import check_drafts_from_states, validate_for_target
from sonar_core.testing.reference_ops import decoder_layer, rms_norm

LAYERS = 3


def _prompts(count: int = 8) -> list[list[int]]:
    return random_prompts(count, seed=5, vocab=500, max_len=40)


@pytest.fixture(scope="module")
def qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("mtp-qwen2"), arch="qwen2", num_layers=LAYERS)


@pytest.fixture(scope="module")
def mimo(qwen2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mimo_target(qwen2, tmp_path_factory.mktemp("mimo") / "t")


@pytest.fixture(scope="module")
def mimo_two_layers(qwen2: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_mimo_target(qwen2, tmp_path_factory.mktemp("mimo2") / "t", num_mtp_layers=2, seed=1)


@pytest.fixture(scope="module")
def reference(qwen2: Path) -> list[list[int]]:
    """Plain greedy output of the Qwen2 checkpoint the MiMo targets copy (same weights)."""
    return greedy_outputs(qwen2, _prompts(), max_num_seqs=8)[0]


def test_the_target_runs_without_speculation_and_its_mtp_tensors_stay_unread(mimo, reference):
    assert greedy_outputs(mimo, _prompts(), max_num_seqs=8)[0] == reference


@pytest.mark.parametrize("depth", [1, 2, 3, 4])
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_output_equals_plain_output(depth, batch, mimo, reference):
    tokens, llm = greedy_outputs(mimo, _prompts(), {"method": "mtp", "num_speculative_tokens": depth}, max_num_seqs=batch)
    assert tokens == reference
    assert llm.get_spec_decode_metrics().num_draft_tokens > 0


@pytest.mark.parametrize("depth", [1, 3])
def test_draft_branches_keep_greedy_output(depth, mimo, reference, monkeypatch):
    """Chains from the MTP layer's next best first tokens, verified beside the request's chain."""
    branch_on_every_step(monkeypatch)
    config = {"method": "mtp", "num_speculative_tokens": depth, "num_draft_branches": 3, "draft_stop_confidence": 0}
    tokens, llm = greedy_outputs(mimo, _prompts(), config, max_num_seqs=8, block_size=4)
    assert tokens == reference
    assert llm.get_spec_decode_metrics().num_draft_tokens > 0


def test_two_layers_in_turn_keep_greedy_output(mimo_two_layers, reference):
    for depth in (2, 4):
        config = {"method": "mtp", "num_speculative_tokens": depth, "draft_stop_confidence": 0}  # both layers drafting
        tokens, llm = greedy_outputs(mimo_two_layers, _prompts(), config)
        assert tokens == reference
    assert len(llm.engine.speculator.proposer.head.layers) == 2


def test_chunked_prefill_and_preemption_keep_greedy_output(mimo, reference):
    config = {"method": "mtp", "num_speculative_tokens": 3}
    assert greedy_outputs(mimo, _prompts(), config, max_num_seqs=4, max_num_batched_tokens=8)[0] == reference
    # 40 blocks of 4 tokens over 3 target layers and the MTP layer (K and V, 2 KV heads x 16 dims,
    # fp32: 512 bytes a layer and block): later requests preempt earlier ones.
    tokens, llm = greedy_outputs(
        mimo, _prompts(), config, max_num_seqs=8, block_size=4, max_model_len=64,
        kv_cache_memory_gb=40 * 512 * (LAYERS + 1) / 2**30,
    )
    assert tokens == reference
    assert llm.engine.num_preemptions > 0


# --- the reference MTP forward (FORMATS.md 5.2, MiMo) --------------------------------------------


class MimoReference:
    """MiMo's MTP layer over a whole sequence in plain torch, from the published tensor names:
    ``u = input_proj([hidden_layernorm(h), token_layernorm(e)])``, a Qwen2 layer, ``final_layernorm``;
    the target's LM head scores it and the normed output is fed back one position further."""

    def __init__(self, target: Path) -> None:
        self.w = load_file(target / "model.safetensors")
        config = json.loads((target / "config.json").read_text())
        self.eps = config["rms_norm_eps"]
        self.heads, self.kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
        self.theta = (config.get("rope_parameters") or {}).get("rope_theta", 10000.0)

    def drafts(self, token_ids: list[int], states: torch.Tensor, depth: int) -> list[int]:
        w, p = self.w, "model.mtp_layers.0."
        tokens, hidden = torch.tensor(token_ids[1:]), states
        drafts = []
        for _ in range(depth):
            e = w["model.embed_tokens.weight"][tokens]
            pair = (rms_norm(hidden, w[f"{p}hidden_layernorm.weight"], self.eps), rms_norm(e, w[f"{p}token_layernorm.weight"], self.eps))
            u = torch.cat(pair, -1) @ w[f"{p}input_proj.weight"].T
            y = decoder_layer(w, p, u, torch.arange(len(u)), self.heads, self.kv_heads, self.theta, self.eps)
            out = rms_norm(y, w[f"{p}final_layernorm.weight"], self.eps)
            draft = int((out[-1] @ w["lm_head.weight"].T).argmax())
            drafts.append(draft)
            tokens = torch.cat((tokens, torch.tensor([draft])))
            hidden = torch.cat((hidden, out[-1:]))
        return drafts


@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-prefill"])
def test_drafts_equal_the_published_mtp_forward(chunked, mimo):
    extra = {"max_num_batched_tokens": 8, "max_num_seqs": 4} if chunked else {}
    config = {"method": "mtp", "num_speculative_tokens": 3, "draft_stop_confidence": 0}  # every chain at full depth
    llm = LLM(model=str(mimo), dtype="float32", device="cpu", speculative_config=config, **extra)
    reference = MimoReference(mimo)
    assert check_drafts_from_states(llm, _prompts(6), lambda hidden: hidden.final, reference.drafts) > 10


# --- probabilistic drafting --------------------------------------------------------------------


def _matching_mtp_target(qwen2: Path, out: Path, noise: float) -> Path:
    """A MiMo target whose every position has one next-token distribution, with an MTP layer that
    drafts from exactly (noise 0) or nearly that distribution: the block adds nothing, input_proj
    passes the normed embedding through, and final_layernorm is the target's final norm."""
    constant = constant_distribution_target(qwen2, out.with_name(out.name + "-constant"))
    target = build_mimo_target(constant, out, init_std=0.05)
    weights = load_file(target / "model.safetensors")
    hidden = weights["model.norm.weight"].shape[0]
    p = "model.mtp_layers.0."
    for name in list(weights):
        if name.startswith(p) and name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    weights[f"{p}input_proj.weight"] = torch.cat((torch.zeros(hidden, hidden), torch.eye(hidden)), dim=1)
    weights[f"{p}token_layernorm.weight"] = torch.ones(hidden)
    generator = torch.Generator().manual_seed(3)
    norm = weights["model.norm.weight"]
    weights[f"{p}final_layernorm.weight"] = norm * (1 + noise * torch.randn(norm.shape, generator=generator))
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def test_an_mtp_layer_of_the_targets_distribution_is_always_accepted(qwen2, tmp_path):
    target = _matching_mtp_target(qwen2, tmp_path / "t", 0.0)
    llm = probabilistic_llm(target, {"method": "mtp", "num_speculative_tokens": 3, "draft_stop_confidence": 0})
    assert per_position_acceptance(llm, depth=3) == [1.0, 1.0, 1.0]


def test_sampled_output_follows_the_target_distribution(qwen2, tmp_path):
    target = _matching_mtp_target(qwen2, tmp_path / "t", 0.5)
    llm = probabilistic_llm(target, {"method": "mtp", "num_speculative_tokens": 2})
    results = sampled_output_distances(llm)
    assert 0.2 < llm.get_spec_decode_metrics().acceptance_rate < 0.9
    assert_follows_target_distribution(results)


# --- startup checks and names ------------------------------------------------------------------


def _check(target: Path, **fields):
    return validate_for_target(target, "mtp", **fields)


def test_the_depth_defaults_to_the_layer_count_and_reuse_warns(mimo, mimo_two_layers):
    assert _check(mimo, method="mtp").num_speculative_tokens == 1
    assert _check(mimo_two_layers, method="mtp").num_speculative_tokens == 2
    warnings = _check(mimo, method="mtp", num_speculative_tokens=3).warnings
    assert any("its one MTP layer, reused" in w and "lower acceptance at later positions" in w for w in warnings)


def test_a_depth_the_layers_cannot_serve_in_turn_is_refused(mimo_two_layers):
    with pytest.raises(ConfigError) as info:
        _check(mimo_two_layers, method="mtp", num_speculative_tokens=3)
    assert info.value.field == "speculative_config.num_speculative_tokens"
    assert "reduce num_speculative_tokens to the checkpoint prediction depth (2)" in info.value.fix


def test_a_target_family_without_mtp_is_refused(qwen2):
    with pytest.raises(ConfigError) as info:
        _check(qwen2, method="mtp")
    assert "'Qwen2ForCausalLM' has no registered MTP implementation" in info.value.message
    assert "MiMoForCausalLM" in info.value.message


def test_missing_mtp_weights_name_the_prefix_looked_for(qwen2, tmp_path):
    target = build_mimo_target(qwen2, tmp_path / "t")
    weights = {k: v for k, v in load_file(target / "model.safetensors").items() if not k.startswith("model.mtp_layers.")}
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError) as info:
        _check(target, method="mtp")
    assert "no MTP weights under 'model.mtp_layers.0.'" in info.value.message


def test_a_misshapen_mtp_tensor_is_named(qwen2, tmp_path):
    target = build_mimo_target(qwen2, tmp_path / "t")
    weights = load_file(target / "model.safetensors")
    weights["model.mtp_layers.0.input_proj.weight"] = weights["model.mtp_layers.0.input_proj.weight"][:, :10].contiguous()
    save_file(weights, str(target / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ConfigError) as info:
        _check(target, method="mtp")
    assert "layers.0.proj.weight" in info.value.message and "wrong shape" in info.value.message


def test_model_names_an_assistant_not_a_draft_model(mimo, qwen2):
    with pytest.raises(ConfigError) as info:
        _check(mimo, method="mtp", model=str(qwen2))
    assert info.value.field == "speculative_config.model"
    assert "names a separate MTP assistant" in info.value.message and "draft_model" in info.value.message


@pytest.mark.parametrize("old_name", ["mimo_mtp", "deepseek_mtp", "qwen3_next_mtp"])
def test_old_names_map_to_mtp_with_a_deprecation_warning(old_name, mimo):
    resolved = _check(mimo, method=old_name)
    assert resolved.config.method == "mtp"
    assert any(f"{old_name!r} is an old name of 'mtp'" in w and '"method": "mtp"' in w for w in resolved.warnings)


def test_mtp_layers_inherit_the_targets_fp8_quantization(mimo, tmp_path):
    """An FP8 block-scaled target (weights and scales in different shards): its MTP layers load
    dequantized exactly like the target's own layers, and output stays lossless."""
    from sonar_core.testing.fp8_checkpoints import write_fp8_checkpoint

    fp8 = write_fp8_checkpoint(mimo, tmp_path / "fp8", block_size=(16, 16), num_shards=2, dequantized_dir=tmp_path / "deq")
    config = {"method": "mtp", "num_speculative_tokens": 2}
    plain, _ = greedy_outputs(fp8, _prompts())
    tokens, llm = greedy_outputs(fp8, _prompts(), config)
    assert tokens == plain
    dequantized = LLM(model=str(tmp_path / "deq"), dtype="float32", device="cpu", speculative_config=config)
    ours = llm.engine.speculator.proposer.head.state_dict()
    theirs = dequantized.engine.speculator.proposer.head.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not torch.equal(ours["layers.0.proj.weight"], load_file(mimo / "model.safetensors")["model.mtp_layers.0.input_proj.weight"])
