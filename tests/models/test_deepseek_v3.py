"""DeepSeek-V3 (MLA + MoE) against transformers' ``deepseek_v3`` on tiny random checkpoints (float32),
through the paged cache with chunked prefill and batched decode, plus its building blocks: the
latent KV cache, YaRN, expert dispatch, the standalone decoder layer and MTP tensors in the
checkpoint."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_model_parity import assert_close, assert_mixed_batch_parity, reference_logits

from aphrodite import LLM, SamplingParams
from sonar_core.engine.kv_budget import bytes_per_block
from sonar_core.kv import KVLayerSpec, allocate_kv_cache
from sonar_core.layers.linear import prepack_linears
from sonar_core.layers.mla import MLAConfig
from sonar_core.models.deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3LayerConfig
from sonar_core.models.loader import load_model
from sonar_core.models.weights import CheckpointError, load_named_weights
from sonar_core.testing.checkpoints import build_tiny_checkpoint

YARN = {
    "rope_type": "yarn",
    "factor": 4.0,
    "original_max_position_embeddings": 8,
    "beta_fast": 32.0,
    "beta_slow": 1.0,
    # mscale != mscale_all_dim: cos/sin are scaled (attention factor 0.96) and so is the softmax.
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
}
# The tiny checkpoints have 2 decoder layers and one MTP layer after them.
MTP_PREFIX = "model.layers.2."
CASES = {
    # The test kit's tiny DeepSeek-V3: query LoRA, interleaved rope, 2 of 8 experts from 1 of 2 groups.
    "q-lora": {},
    "no-q-lora": {
        "config_overrides": {
            "q_lora_rank": None,
            "attention_bias": True,
            "rope_interleave": False,
            "norm_topk_prob": False,
            "topk_group": 2,
            "num_experts_per_tok": 3,
        }
    },
    # Positions run past the original 8-token context.
    "yarn": {"rope_parameters": YARN, "max_position_embeddings": 64},
}


def _layer_tensors(tensors: dict[str, torch.Tensor], index: int) -> dict[str, torch.Tensor]:
    """Decoder layer ``index``'s tensors, named relative to the layer."""
    prefix = f"model.layers.{index}."
    return {name.removeprefix(prefix): t for name, t in tensors.items() if name.startswith(prefix)}


def _randomize_router_bias(folder: Path, seed: int) -> None:
    """transformers initialises e_score_correction_bias to zero; a random one checks that it steers
    the choice of experts without weighting them."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    for name in [n for n in tensors if n.endswith("mlp.gate.e_score_correction_bias")]:
        tensors[name] = torch.rand(tensors[name].shape, generator=generator) * 0.5
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    built: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in built:
            folder = build_tiny_checkpoint(tmp_path_factory.mktemp(f"deepseek-{case}"), "deepseek_v3", **CASES[case])
            _randomize_router_bias(folder, seed=len(built))
            built[case] = folder
        return built[case]

    return get


@pytest.mark.parametrize("case", sorted(CASES))
def test_logits_match_transformers(case, checkpoint, paged_runner, hf_reference):
    path = checkpoint(case)
    model = load_model(path, torch.float32, "cpu").model
    assert_mixed_batch_parity(model, hf_reference(path), paged_runner, steps=5, label=case)


def test_captured_states_match_transformers_hidden_states(checkpoint, paged_runner, hf_reference):
    path = checkpoint("q-lora")
    model = load_model(path, torch.float32, "cpu").model
    hf = hf_reference(path)
    prompts = {"a": [3, 14, 15, 92, 65, 35], "b": [8, 9]}
    # Sonar's index: the state after k layers (0: embeddings; 2: the last layer's raw output).
    _, captured = paged_runner(model).step(prompts, capture_layers=(2, 0, 1))
    for seq, tokens in prompts.items():
        with torch.no_grad():
            states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        for layer in (0, 1):
            torch.testing.assert_close(captured[layer][seq], states[layer][0], rtol=0, atol=1e-4)
        with torch.no_grad():  # transformers' last entry is normed
            torch.testing.assert_close(model.model.norm(captured[2][seq]), states[2][0], rtol=0, atol=1e-4)


def test_greedy_generation_through_the_engine_matches_transformers(checkpoint, hf_reference):
    path = checkpoint("q-lora")
    llm = LLM(model=str(path), dtype="float32", device="cpu", max_num_seqs=4)
    hf = hf_reference(path)
    rng = random.Random(1)
    prompts = [[rng.randrange(hf.config.vocab_size) for _ in range(n)] for n in (3, 9, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for prompt, tokens in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert tokens == out[0, len(prompt) :].tolist()
    assert len({t for tokens in ours for t in tokens}) > 5, "the tiny checkpoint's greedy text should vary"


def test_the_cache_holds_one_latent_row_per_token(checkpoint):
    model = load_model(checkpoint("q-lora"), torch.float32, "cpu").model
    config = model.hf_config
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    specs = model.kv_cache_specs()
    assert specs == [KVLayerSpec(num_kv_heads=1, head_dim=latent, value_head_dim=0)] * config.num_hidden_layers
    (k_cache, v_cache), *_ = allocate_kv_cache(specs, num_blocks=3, block_size=4, dtype=torch.float32, device="cpu")
    assert k_cache.shape == (3, 4, 1, latent) and v_cache.numel() == 0
    assert bytes_per_block(specs, 4, torch.float32) == config.num_hidden_layers * 4 * latent * 4
    # Specs without a value width keep their old meaning.
    assert KVLayerSpec(2, 16).value_dim == 16 and KVLayerSpec(2, 16).elements_per_token == 64


def test_yarn_frequencies_and_scales_equal_transformers(checkpoint, hf_reference):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = hf_reference(checkpoint("yarn"))
    ours = MLAConfig.from_hf_config(hf.config)
    for params in (YARN, {**YARN, "truncate": False, "beta_fast": 4.0, "original_max_position_embeddings": 32}):
        hf.config.rope_parameters = {"rope_theta": 10000.0, **params}
        inv_freq, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf.config)
        config = MLAConfig.from_hf_config(hf.config)
        torch.testing.assert_close(config.rope.inv_freq(), inv_freq, rtol=0, atol=0)
        assert config.rope_attention_factor == pytest.approx(attention_factor) and attention_factor != 1.0
    assert ours.softmax_scale == pytest.approx(hf.model.layers[0].self_attn.scaling)
    assert ours.softmax_scale != pytest.approx(ours.qk_head_dim**-0.5)


def test_moe_runs_only_the_experts_that_received_tokens(checkpoint, paged_runner):
    model = load_model(checkpoint("q-lora"), torch.float32, "cpu").model
    moe = model.model.layers[1].mlp
    calls: list[int] = []
    for index, expert in enumerate(moe.experts):
        expert.register_forward_hook(lambda module, args, out, index=index: calls.append(args[0].shape[0]))
    runner = paged_runner(model)
    runner.step({"a": [5, 6, 7]})
    calls.clear()
    runner.step({"a": [8]})  # one decode token: exactly num_experts_per_tok experts, one row each
    assert calls == [1] * moe.config.num_experts_per_tok


def test_router_stays_float32_in_a_bf16_model(checkpoint, paged_runner):
    path = checkpoint("q-lora")
    bf16 = load_model(path, torch.bfloat16, "cpu").model
    gate = bf16.model.layers[1].mlp.gate
    assert gate.weight.dtype == gate.e_score_correction_bias.dtype == torch.float32
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    prompt = {"a": list(range(100, 120))}
    low, _ = paged_runner(bf16).step(prompt)
    ref, _ = paged_runner(load_model(path, torch.float32, "cpu").model).step(prompt)
    # bf16 keeps ~3 significant digits (logits ~10 here); a token whose candidate experts nearly tie
    # may route differently from float32 (as it does in transformers), so most rows, not all.
    row_errors = (low["a"] - ref["a"]).abs().amax(dim=-1)
    assert (row_errors < 0.5).float().mean().item() >= 0.8, row_errors


def test_a_standalone_layer_loads_its_tensors_and_equals_the_models(checkpoint, paged_runner):
    path = checkpoint("q-lora")
    model = load_model(path, torch.float32, "cpu").model
    config = model.hf_config
    # The MTP layer's index: MoE (index >= first_k_dense_replace), built from the config alone.
    layer = DeepseekV3DecoderLayer.from_hf_config(config, config.num_hidden_layers)
    assert layer.kv_spec() == model.kv_cache_specs()[1]
    source = model.model.layers[1]
    tensors = _layer_tensors(load_file(path / "model.safetensors"), 1).items()
    load_named_weights(layer, tensors, DeepseekV3LayerConfig.from_hf_config(config).fused_projections())
    prepack_linears(layer)  # as load_head_checkpoint does, so both take the same matmul paths

    runner = paged_runner(model)
    metadata = runner.metadata({"a": [1, 2, 3, 4, 5], "b": [6, 7]})
    num_blocks = runner.caches[0][0].shape[0]
    caches = allocate_kv_cache([layer.kv_spec()] * 2, num_blocks, runner.block_size, torch.float32, "cpu")
    hidden = torch.randn(7, config.hidden_size)
    cos, sin = model.rotary.cos_sin(metadata.positions, hidden.dtype)
    with torch.inference_mode():
        expected = source(hidden, cos, sin, caches[0], metadata)
        got = layer(hidden, cos, sin, caches[1], metadata)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.fixture(scope="module")
def with_mtp_layer(checkpoint, tmp_path_factory) -> Path:
    """The q-lora checkpoint plus a DeepSeek MTP layer at ``model.layers.{num_hidden_layers}``."""
    source = checkpoint("q-lora")
    folder = tmp_path_factory.mktemp("deepseek-mtp")
    for item in source.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    hidden = tensors["model.norm.weight"].shape[0]
    # A decoder layer (a copy of the last one) and the MTP head's own tensors (FORMATS.md 5.1).
    mtp = {name: t.clone() for name, t in _layer_tensors(tensors, 1).items()}
    mtp.update({
        "enorm.weight": torch.ones(hidden),
        "hnorm.weight": torch.ones(hidden),
        "eh_proj.weight": torch.randn(hidden, 2 * hidden),
        "shared_head.norm.weight": torch.ones(hidden),
        "shared_head.head.weight": tensors["lm_head.weight"].clone(),
        "embed_tokens.weight": tensors["model.embed_tokens.weight"].clone(),
    })
    tensors.update({f"{MTP_PREFIX}{name}": t for name, t in mtp.items()})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_a_checkpoint_with_mtp_tensors_loads_with_them_claimed(with_mtp_layer, checkpoint, paged_runner):
    plain = load_model(checkpoint("q-lora"), torch.float32, "cpu").model
    claimed = load_model(with_mtp_layer, torch.float32, "cpu", claimed_prefixes=(MTP_PREFIX,)).model
    unclaimed = load_model(with_mtp_layer, torch.float32, "cpu").model  # skipped, as transformers does
    prompt = {"a": [9, 8, 7, 6, 5, 4]}
    expected, _ = paged_runner(plain).step(prompt)
    for model in (claimed, unclaimed):
        assert len(model.model.layers) == 2
        got, _ = paged_runner(model).step(prompt)
        torch.testing.assert_close(got["a"], expected["a"], rtol=0, atol=0)


def test_tensors_beyond_the_mtp_layers_are_still_rejected(with_mtp_layer, tmp_path):
    for item in with_mtp_layer.iterdir():
        (tmp_path / item.name).write_bytes(item.read_bytes())
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.layers.3.enorm.weight"] = torch.ones(4)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"unexpected in the checkpoint \(1\): model.layers.3.enorm.weight"):
        load_model(tmp_path, torch.float32, "cpu")


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"n_group": 3}, r"n_routed_experts \(8\) must be a positive multiple of n_group \(3\)"),
        ({"topk_group": 3}, r"topk_group \(3\) must be in 1..n_group \(2\)"),
        ({"num_experts_per_tok": 5}, r"num_experts_per_tok \(5\) must be in 1..4"),
        ({"scoring_func": "softmax"}, r"scoring_func='softmax'.*not supported"),
        ({"head_dim": 16}, r"head_dim \(16\) must equal qk_rope_head_dim \(8\)"),
        ({"rope_parameters": {"rope_type": "dynamic", "factor": 2.0}}, r"rope type 'dynamic' is not supported"),
    ],
)
def test_unsupported_configs_are_refused_by_name(checkpoint, overrides, message):
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(checkpoint("q-lora"))
    for key, value in overrides.items():
        setattr(config, key, value)
    with pytest.raises(ValueError, match=message):
        DeepseekV3LayerConfig.from_hf_config(config)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_logits_match_transformers(checkpoint, paged_runner, hf_reference):
    path = checkpoint("q-lora")
    model = load_model(path, torch.float32, "cuda").model
    hf = hf_reference(path)
    prompts = {"a": [5, 9, 13, 2, 77, 31], "b": [400, 401]}
    runner = paged_runner(model, block_size=4)
    logits, _ = runner.step(prompts)
    for seq, tokens in prompts.items():
        assert_close(logits[seq].cpu(), reference_logits(hf, tokens), f"cuda prefill {seq}")
    logits, _ = runner.step({"a": [8], "b": [9]})
    for seq, token in (("a", 8), ("b", 9)):
        assert_close(logits[seq].cpu(), reference_logits(hf, prompts[seq] + [token])[-1:], f"cuda decode {seq}")
