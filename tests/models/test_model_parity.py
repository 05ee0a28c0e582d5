"""Our model code against transformers' forward on the same tiny random checkpoints (float32).

Tolerance: max |logit difference| <= 1e-4 (logits here reach about 10 in magnitude; the observed
error is about 1e-5, float32 rounding of differently ordered sums).
"""

from __future__ import annotations

import random

import pytest
import torch

from sonar_core import cpu_kernels
from sonar_core.layers.linear import (
    Linear,
    cpu_prepack_available,
    drop_prepacked,
    pack_skinny,
    prepack_linears,
)
from sonar_core.models.loader import load_model

ATOL = 1e-4
CASES = [
    pytest.param("llama", False, {}, id="llama-untied"),
    pytest.param("llama", True, {}, id="llama-tied"),
    pytest.param("qwen2", False, {}, id="qwen2-untied"),
    pytest.param("qwen2", True, {}, id="qwen2-tied"),
    # head_dim (32) differs from hidden_size // num_heads (16): it must come from the config.
    pytest.param("qwen3", False, {"head_dim": 32}, id="qwen3-untied"),
    pytest.param("qwen3", True, {"head_dim": 32}, id="qwen3-tied"),
    pytest.param(
        "llama",
        False,
        {
            "rope_parameters": {
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            }
        },
        id="llama3-rope",
    ),
    # Sliding-window layers with windows shorter than the prompts, the chunks and the decode history.
    pytest.param(
        "qwen3",
        False,
        {
            "config_overrides": {
                "use_sliding_window": True,
                "sliding_window": 3,
                "layer_types": ["sliding_attention", "full_attention"],
            }
        },
        id="qwen3-sliding-layer-types",
    ),
    pytest.param(
        "qwen2",
        True,
        {"config_overrides": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 1}},
        id="qwen2-sliding-max-window-layers",
    ),
]


def reference_logits(hf, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


def assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    err = (ours - ref).abs().max().item()
    assert err <= ATOL, f"{what}: max abs logit error {err:.2e} > {ATOL:.0e}"


@pytest.mark.parametrize("arch,tied,extra", CASES)
def test_logits_match_transformers(arch, tied, extra, checkpoints, paged_runner, hf_reference):
    path = checkpoints.get(arch, tie_word_embeddings=tied, **extra)
    model = load_model(path, torch.float32, "cpu").model
    assert_mixed_batch_parity(model, hf_reference(path), paged_runner, steps=4)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_logits_match_transformers_on_the_pytorch_operators(arch, checkpoints, paged_runner, hf_reference):
    """The same parity where Sonar's CPU kernels are not in use (no compiler, SONAR_CPU_KERNELS=0):
    the cases above run on the kernels wherever they are built."""
    path = checkpoints.get(arch, **({"head_dim": 32} if arch == "qwen3" else {}))
    model = load_model(path, torch.float32, "cpu").model
    with cpu_kernels.disabled():
        assert_mixed_batch_parity(model, hf_reference(path), paged_runner, steps=4)


def assert_mixed_batch_parity(model, hf, paged_runner, steps: int, verify_from: int | None = None, label: str = "") -> None:
    """Our logits equal transformers' through a paged batch that mixes everything a step can hold:
    a prefill of three sequences whose lengths straddle block boundaries (block size 4), then
    ``steps`` decode steps in which a late prompt arrives in two chunks beside the decodes and,
    from step ``verify_from`` on, sequence "a" verifies four tokens at once (a speculative step)."""
    rng = random.Random(0)
    vocab = model.shared_modules().vocab_size
    history = {s: [rng.randrange(vocab) for _ in range(n)] for s, n in (("a", 5), ("b", 11), ("c", 2))}
    runner = paged_runner(model, block_size=4)
    prefix = f"{label} " if label else ""

    logits, _ = runner.step(dict(history))
    for seq, tokens in history.items():
        assert_close(logits[seq], reference_logits(hf, tokens), f"{prefix}prefill {seq}")

    late_prompt = [rng.randrange(vocab) for _ in range(13)]
    chunks = {1: late_prompt[:7], 2: late_prompt[7:]}
    for step in range(steps):
        new = {seq: [rng.randrange(vocab)] for seq in history}
        if step in chunks:
            new["d"] = chunks[step]
        if verify_from is not None and step >= verify_from:
            new["a"] = [rng.randrange(vocab) for _ in range(4)]
        logits, _ = runner.step(new)
        for seq, tokens in new.items():
            history[seq] = history.get(seq, []) + tokens
            ref = reference_logits(hf, history[seq])[-len(tokens) :]
            assert_close(logits[seq], ref, f"{prefix}step {step} {seq}")


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_greedy_generation_matches_transformers(arch, checkpoints, paged_runner, hf_reference):
    path = checkpoints.get(arch, tie_word_embeddings=arch == "llama")
    loaded = load_model(path, torch.float32, "cpu")
    hf = hf_reference(path)
    prompts = {"short": [11, 57, 300], "long": list(range(40, 61))}
    ours = paged_runner(loaded.model, block_size=4).greedy(prompts, max_new_tokens=20, eos_ids=loaded.eos_token_ids)
    for seq, prompt in prompts.items():
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=20)
        expected = out[0, len(prompt) :].tolist()
        assert ours[seq] == expected, f"{arch} {seq}"
    assert len(set(ours["short"] + ours["long"])) > 5, "the tiny checkpoint's greedy text should vary"


def test_captured_states_match_transformers_hidden_states(checkpoints, paged_runner, hf_reference):
    path = checkpoints.get("qwen3", num_layers=3, head_dim=32)
    model = load_model(path, torch.float32, "cpu").model
    hf = hf_reference(path)
    prompts = {"a": [3, 14, 15, 92, 65, 35], "b": [8, 9]}
    runner = paged_runner(model, block_size=4)
    # Sonar's index: the state after k layers (0: embeddings; 3: the last layer's raw output).
    _, captured = runner.step(prompts, capture_layers=(3, 0, 1, 2))
    assert sorted(captured) == [0, 1, 2, 3]
    for seq, tokens in prompts.items():
        with torch.no_grad():
            states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        # transformers' tuple has the same index, except the last entry, which is normed.
        for layer in (0, 1, 2):
            err = (captured[layer][seq] - states[layer][0]).abs().max().item()
            assert err < 1e-4, f"state {layer} {seq}: {err:.2e}"
        with torch.no_grad():
            last = model.model.norm(captured[3][seq])
        assert (last - states[3][0]).abs().max().item() < 1e-4


def test_capture_refuses_states_outside_the_model(checkpoints):
    from sonar_core.models.hidden_capture import HiddenStateCapture

    with pytest.raises(ValueError, match=r"outside 0\.\.3"):
        HiddenStateCapture((4,), 3, 8, 4, torch.float32, "cpu")
    with pytest.raises(ValueError, match="repeat"):
        HiddenStateCapture((1, 1), 3, 8, 4, torch.float32, "cpu")


def test_inputs_embeds_equal_input_ids(checkpoints, paged_runner):
    model = load_model(checkpoints.get("llama"), torch.float32, "cpu").model
    tokens = [5, 6, 7, 8, 9]
    runner_ids, runner_embeds = paged_runner(model), paged_runner(model)
    metadata = runner_ids.metadata({"a": tokens})
    with torch.inference_mode():
        ids = torch.tensor(tokens)
        by_ids = model(ids, metadata.positions, runner_ids.caches, metadata)
        metadata = runner_embeds.metadata({"a": tokens})
        by_embeds = model(None, metadata.positions, runner_embeds.caches, metadata, inputs_embeds=model.embed_tokens(ids))
    torch.testing.assert_close(by_ids, by_embeds, rtol=0, atol=0)


def test_tied_lm_head_shares_the_embedding(checkpoints):
    tied = load_model(checkpoints.get("llama", tie_word_embeddings=True), torch.float32, "cpu").model
    untied = load_model(checkpoints.get("llama"), torch.float32, "cpu").model
    assert tied.lm_head.weight is tied.model.embed_tokens.weight
    assert untied.lm_head.weight.data_ptr() != untied.model.embed_tokens.weight.data_ptr()


def test_kv_cache_specs_follow_the_config(checkpoints):
    model = load_model(checkpoints.get("qwen3", num_layers=3, head_dim=32), torch.float32, "cpu").model
    specs = model.kv_cache_specs()
    assert len(specs) == 3
    assert {(s.num_kv_heads, s.head_dim) for s in specs} == {(2, 32)}


def test_bfloat16_model_tracks_float32(checkpoints, paged_runner):
    path = checkpoints.get("llama")
    fp32 = load_model(path, torch.float32, "cpu").model
    bf16 = load_model(path, torch.bfloat16, "cpu").model
    assert next(bf16.parameters()).dtype == torch.bfloat16
    prompt = {"a": list(range(100, 120))}
    ref, _ = paged_runner(fp32).step(prompt)
    low, _ = paged_runner(bf16).step(prompt)
    assert low["a"].dtype == torch.float32
    # bf16 keeps ~3 significant digits; the logits of this model have magnitude ~10.
    assert (low["a"] - ref["a"]).abs().max().item() < 0.5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_prepacked_projections_match_plain_ones(checkpoints, paged_runner, dtype):
    model = load_model(checkpoints.get("qwen2"), dtype, "cpu").model
    if model.lm_head.packed_from is None:
        pytest.skip(f"neither Sonar's kernels nor this torch build pack {dtype} weights here")
    assert model.model.layers[1].mlp.down_proj.packed_from is not None
    prompt = {"a": list(range(30, 47)), "b": [7, 8]}
    packed, _ = paged_runner(model).step(prompt)
    drop_prepacked(model)
    plain, _ = paged_runner(model).step(prompt)
    for seq in prompt:
        torch.testing.assert_close(packed[seq], plain[seq], rtol=0, atol=1e-2 if dtype == torch.bfloat16 else 1e-4)


def test_a_layer_holds_at_most_one_packed_copy(checkpoints):
    """The skinny kernel's copy where it takes the weight, oneDNN's otherwise: the weights are
    held at most twice (dense and packed)."""
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        model = load_model(checkpoints.get("llama"), dtype, "cpu").model
        for layer in model.modules():
            if isinstance(layer, Linear):
                assert layer.packed_weight is None or layer.skinny_weight is None
                assert (layer.skinny_weight is not None) == bool(pack_skinny(layer.weight.detach())[1])


def test_moving_a_packed_layer_drops_the_pack():
    layer = Linear(8, 4).to(torch.bfloat16)
    expected = 1 if cpu_prepack_available(torch.bfloat16) or pack_skinny(layer.weight.detach())[1] else 0
    assert prepack_linears(layer) == expected
    layer.to(torch.float32)
    assert layer.packed_weight is None and layer.skinny_weight is None
    x = torch.randn(3, 8)
    torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_cuda_logits_match_transformers(arch, checkpoints, paged_runner, hf_reference):
    path = checkpoints.get(arch, tie_word_embeddings=True)
    model = load_model(path, torch.float32, "cuda").model
    hf = hf_reference(path)
    prompts = {"a": [5, 9, 13, 2, 77, 31], "b": [400, 401]}
    runner = paged_runner(model, block_size=4)
    logits, _ = runner.step(prompts)
    for seq, tokens in prompts.items():
        assert_close(logits[seq].cpu(), reference_logits(hf, tokens), f"cuda prefill {seq}")
    logits, _ = runner.step({"a": [8], "b": [9]})
    assert_close(logits["a"].cpu(), reference_logits(hf, prompts["a"] + [8])[-1:], "cuda decode a")
