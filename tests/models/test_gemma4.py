"""Gemma 4's text decoder against transformers' ``gemma4`` on tiny random checkpoints (float32),
through the paged cache: chunked prefill, batched decode and multi-token steps, for sliding/full
layer mixes with windows shorter than the prompts, per-layer inputs, KV sharing, ``k_eq_v``,
double-wide MLPs, the MoE block, logit softcapping and a multimodal checkpoint whose towers are
skipped."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_model_parity import assert_close, assert_mixed_batch_parity, reference_logits

from aphrodite import LLM, SamplingParams
from sonar_core.layers.rotary import RopeConfig
from sonar_core.models.loader import load_model
from sonar_core.testing.checkpoints import build_tiny_checkpoint

S, F = "sliding_attention", "full_attention"
CASES = {
    # Window 3: shorter than every prompt, chunk and multi-token step below. Per-layer inputs on.
    "sliding-ple": ("gemma4_text", {"num_layers": 4, "config_overrides": {"layer_types": [S, F, S, F], "sliding_window": 3}}),
    # Layers 3 (sliding) and 4 (full) read the caches of layers 2 and 1; full layers project keys
    # once (k_eq_v, one global KV head), shared layers have a double-wide MLP; logits are capped.
    "kv-shared": (
        "gemma4_text",
        {
            "num_layers": 5,
            "config_overrides": {
                "layer_types": [S, F, S, S, F],
                "sliding_window": 3,
                "num_kv_shared_layers": 2,
                "attention_k_eq_v": True,
                "num_global_key_value_heads": 1,
                "use_double_wide_mlp": True,
                "final_logit_softcapping": 8.0,
            },
        },
    ),
    # Routed experts beside the dense MLP, without per-layer inputs, with attention biases.
    "moe": (
        "gemma4_text",
        {
            "num_layers": 2,
            "config_overrides": {
                "hidden_size_per_layer_input": 0,
                "attention_bias": True,
                "enable_moe_block": True,
                "num_experts": 4,
                "top_k_experts": 2,
                "moe_intermediate_size": 32,
            },
        },
    ),
    # The released layout: Gemma4ForConditionalGeneration with a (tiny) vision tower to skip.
    "multimodal": (
        "gemma4",
        {"num_layers": 4, "config_overrides": {"layer_types": [S, F, S, F], "sliding_window": 4, "num_kv_shared_layers": 1}},
    ),
}


def _randomize_scales(folder: Path, seed: int) -> None:
    """transformers initialises every norm weight, layer scalar and router scale to one, which would
    hide a wrong norm formula or a missing scalar; random values in [0.75, 1.25] expose them (wider
    q/k norm scales sharpen the softmax enough to amplify float32 rounding past the tolerance)."""
    path = folder / "model.safetensors"
    tensors = load_file(path)
    generator = torch.Generator().manual_seed(seed)
    scales = ("norm.weight", "layer_scalar", "router.scale", "router.per_expert_scale")
    for name in [n for n in tensors if n.endswith(scales)]:
        tensors[name] = 0.75 + 0.5 * torch.rand(tensors[name].shape, generator=generator)
    save_file(tensors, str(path), metadata={"format": "pt"})


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory):
    built: dict[str, Path] = {}

    def get(case: str) -> Path:
        if case not in built:
            arch, kwargs = CASES[case]
            folder = build_tiny_checkpoint(tmp_path_factory.mktemp(f"gemma4-{case}"), arch, **kwargs)
            _randomize_scales(folder, seed=len(built))
            built[case] = folder
        return built[case]

    return get


@pytest.mark.parametrize("case", list(CASES))
def test_logits_match_transformers(case, checkpoint, paged_runner, hf_reference):
    path = checkpoint(case)
    model = load_model(path, torch.float32, "cpu").model
    assert_mixed_batch_parity(model, hf_reference(path), paged_runner, steps=5, verify_from=3, label=case)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", ["kv-shared", "moe"])
def test_cuda_logits_match_transformers(case, checkpoint, paged_runner, hf_reference):
    path = checkpoint(case)
    model = load_model(path, torch.float32, "cuda").model
    hf = hf_reference(path)
    prompts = {"a": [5, 9, 13, 2, 77, 31, 8], "b": [400, 401]}
    runner = paged_runner(model, block_size=4)
    logits, _ = runner.step(prompts)
    for seq, tokens in prompts.items():
        assert_close(logits[seq].cpu(), reference_logits(hf, tokens), f"cuda prefill {seq}")
    logits, _ = runner.step({"a": [8, 3, 6], "b": [9]})
    assert_close(logits["a"].cpu(), reference_logits(hf, prompts["a"] + [8, 3, 6])[-3:], "cuda verify a")
    assert_close(logits["b"].cpu(), reference_logits(hf, prompts["b"] + [9])[-1:], "cuda decode b")


def test_kv_sharing_layers_read_their_producers_caches(checkpoint):
    from transformers import AutoConfig

    path = checkpoint("kv-shared")
    model = load_model(path, torch.float32, "cpu").model
    text = AutoConfig.from_pretrained(path)
    # Five layers, three caches: layers 3 and 4 read those of layers 2 (sliding) and 1 (full).
    assert model.kv_cache_index == (0, 1, 2, 2, 1)
    specs = model.kv_cache_specs()
    assert [(s.num_kv_heads, s.head_dim) for s in specs] == [(2, 16), (1, 32), (2, 16)]
    # The caches an assistant reads are those transformers marks "store".
    stored = {text.layer_types[i]: i for i, mode in enumerate(text.kv_sharing_modes) if mode == "store"}
    assert model.kv_producer_cache_indices() == {kind: model.kv_cache_index[i] for kind, i in stored.items()}
    layers = model.language_model.layers
    assert not hasattr(layers[3].self_attn, "qkv_proj") and not hasattr(layers[3].self_attn, "k_norm")
    assert layers[4].mlp.down_proj.in_features == 2 * layers[1].mlp.down_proj.in_features
    # k_eq_v: the full layer's fused projection holds q and k only.
    assert layers[1].self_attn.qkv_proj.out_features == (4 + 1) * 32


def test_multimodal_checkpoint_loads_the_language_model_only(checkpoint):
    from safetensors import safe_open

    path = checkpoint("multimodal")
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        names = list(f.keys())
    assert any(n.startswith("model.vision_tower.") for n in names)
    loaded = load_model(path, torch.float32, "cpu")
    assert type(loaded.model).__name__ == "Gemma4ForConditionalGeneration"
    assert loaded.max_model_len == 2048  # the text_config's
    params = [name for name, _ in loaded.model.named_parameters()]
    assert params and all(n.startswith("model.language_model.") or n == "lm_head.weight" for n in params)


def test_captured_states_match_transformers_hidden_states(checkpoint, paged_runner, hf_reference):
    path = checkpoint("kv-shared")
    model = load_model(path, torch.float32, "cpu").model
    hf = hf_reference(path)
    prompts = {"a": [3, 14, 15, 92, 65, 35], "b": [8, 9]}
    _, captured = paged_runner(model).step(prompts, capture_layers=(5, 0, 2, 4))
    for seq, tokens in prompts.items():
        with torch.no_grad():
            states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        for layer in (0, 2, 4):  # 0: the scaled embeddings
            torch.testing.assert_close(captured[layer][seq], states[layer][0], rtol=0, atol=1e-4)
        with torch.no_grad():  # transformers' last entry is normed
            last = model.shared_modules().final_norm(captured[5][seq])
        torch.testing.assert_close(last, states[5][0], rtol=0, atol=1e-4)


def test_greedy_generation_through_the_engine_matches_transformers(checkpoint, hf_reference):
    path = checkpoint("multimodal")
    llm = LLM(model=str(path), dtype="float32", device="cpu", max_num_seqs=4)
    hf = hf_reference(path)
    rng = random.Random(1)
    vocab = hf.config.get_text_config().vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(n)] for n in (3, 9, 20)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    ours = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    for prompt, tokens in zip(prompts, ours, strict=True):
        with torch.no_grad():
            out = hf.generate(
                torch.tensor([prompt]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
            )
        assert tokens == out[0, len(prompt) :].tolist()
    assert len({t for tokens in ours for t in tokens}) > 5, "the tiny checkpoint's greedy text should vary"


def test_proportional_rope_matches_transformers():
    from transformers import Gemma4TextConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = {"rope_type": "proportional", "partial_rotary_factor": 0.25, "rope_theta": 1e6, "factor": 2.0}
    config = Gemma4TextConfig(
        num_hidden_layers=2, global_head_dim=64, rope_parameters={S: {"rope_type": "default", "rope_theta": 1e4}, F: params}
    )
    theirs, _ = ROPE_INIT_FUNCTIONS["proportional"](config, layer_type=F)
    ours = RopeConfig.from_parameters(params, head_dim=64, max_position_embeddings=128).inv_freq()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
    assert int((ours != 0).sum()) == 8  # a quarter of the 32 frequency pairs rotate


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"use_bidirectional_attention": "all"}, "use_bidirectional_attention='all'"),
        ({"num_kv_shared_layers": 2}, "num_kv_shared_layers"),
        (
            {"rope_parameters": {S: {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4, "partial_rotary_factor": 0.5}, F: {"rope_type": "default", "rope_theta": 1e4}}},
            "partial rotary embeddings",
        ),
    ],
    ids=["bidirectional", "no-producer", "partial-rope"],
)
def test_unsupported_configs_are_refused(overrides, message):
    from transformers import Gemma4TextConfig

    from sonar_core.models.gemma4 import Gemma4ForCausalLM

    config = Gemma4TextConfig(
        vocab_size=64, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
        head_dim=8, global_head_dim=16, vocab_size_per_layer_input=64, hidden_size_per_layer_input=4,
        num_hidden_layers=2, layer_types=[S, F], **overrides,
    )
    with pytest.raises(ValueError, match=message):
        Gemma4ForCausalLM(config)
