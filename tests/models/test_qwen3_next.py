"""Qwen3-Next (gated DeltaNet + gated full attention + MoE) against transformers' ``qwen3_next`` on
tiny random checkpoints (float32): batched prefill of rows that take either form of the delta
rule, decode, chunked prefill, speculative rows whose per-position states are committed
afterwards, the two expert layouts, MTP tensors, and the building blocks (norms, partial rotary,
delta rule, the standalone full-attention layer)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from test_model_parity import assert_close, assert_mixed_batch_parity, reference_logits

from sonar_core.kv import StateLayerSpec, allocate_kv_cache
from sonar_core.layers.delta_rule import chunked_gated_delta_rule, l2_normalize, recurrent_gated_delta_rule
from sonar_core.layers.linear import prepack_linears
from sonar_core.layers.norms import GatedRMSNorm, ZeroCentredRMSNorm
from sonar_core.layers.recurrent_batch import RECURRENT_MAX_TOKENS
from sonar_core.layers.rotary import RopeConfig, RotaryEmbedding, apply_rotary
from sonar_core.models.loader import load_model
from sonar_core.models.qwen3_next import Qwen3NextAttentionLayer, Qwen3NextLayerConfig
from sonar_core.models.weights import load_named_weights

VOCAB = 512
# Layer types [linear, full, linear, full]: two KV caches, two recurrent states.
NUM_LAYERS = 4


@pytest.fixture(scope="module")
def checkpoint(checkpoints) -> Path:
    return checkpoints.get("qwen3_next", num_layers=NUM_LAYERS)


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint, torch.float32, "cpu").model


@pytest.fixture(scope="module")
def hf(checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()


def _tokens(rng: random.Random, count: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(count)]


def _slot_states(runner, seq: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The committed (conv window, recurrent state) of ``seq`` in every recurrent layer."""
    slot = runner.states.acquire(seq)
    return [(layer.conv[slot].clone(), layer.recurrent[slot].clone()) for layer in runner.states.layers]


def _assert_states_close(got, expected, what: str) -> None:
    """Float32 rounding only: a verified row and token-by-token decoding take different kernels
    (a step of several queries attends through SDPA, a decode step through Sonar's CPU kernel), so
    states of magnitude ~10 may differ by ~1e-5; a wrong rollback differs by O(1)."""
    for index, ((conv, recurrent), (conv_ref, recurrent_ref)) in enumerate(zip(got, expected, strict=True)):
        torch.testing.assert_close(conv, conv_ref, rtol=1e-5, atol=1e-5, msg=f"{what}: conv window of layer {index}")
        torch.testing.assert_close(
            recurrent, recurrent_ref, rtol=1e-5, atol=1e-5, msg=f"{what}: recurrent state of layer {index}"
        )


def test_the_caches_follow_the_layer_types(model):
    config = model.hf_config
    assert config.layer_types == ["linear_attention", "full_attention"] * 2
    assert len(model.kv_cache_specs()) == 2
    assert {(s.num_kv_heads, s.head_dim) for s in model.kv_cache_specs()} == {(config.num_key_value_heads, config.head_dim)}
    conv_dim = 2 * config.linear_num_key_heads * config.linear_key_head_dim + (
        config.linear_num_value_heads * config.linear_value_head_dim
    )
    recurrent = (config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim)
    expected = StateLayerSpec(conv_shape=(conv_dim, config.linear_conv_kernel_dim - 1), recurrent_shape=recurrent)
    assert model.state_specs() == [expected] * 2


def test_prefill_of_mixed_lengths_then_decode_matches_transformers(model, hf, paged_runner):
    # Lengths on both sides of RECURRENT_MAX_TOKENS, within one chunk of 64 and across several.
    rng = random.Random(0)
    lengths = {"one": 1, "short": RECURRENT_MAX_TOKENS, "mid": RECURRENT_MAX_TOKENS + 5, "long": 70, "longer": 131}
    history = {seq: _tokens(rng, n) for seq, n in lengths.items()}
    runner = paged_runner(model, block_size=4)
    logits, _ = runner.step(dict(history))
    for seq, tokens in history.items():
        assert_close(logits[seq], reference_logits(hf, tokens), f"prefill {seq}")
    for step in range(3):
        new = {seq: _tokens(rng, 1) for seq in history}
        logits, _ = runner.step(new)
        for seq, tokens in new.items():
            history[seq] += tokens
            assert_close(logits[seq], reference_logits(hf, history[seq])[-1:], f"decode {step} {seq}")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_mixed_batches_match_transformers(tied, checkpoints, paged_runner, hf_reference):
    path = checkpoints.get("qwen3_next", num_layers=NUM_LAYERS, tie_word_embeddings=tied)
    model = load_model(path, torch.float32, "cpu").model
    assert_mixed_batch_parity(model, hf_reference(path), paged_runner, steps=4, verify_from=2, label="qwen3_next")


def test_chunked_prefill_equals_unchunked(model, hf, paged_runner):
    rng = random.Random(1)
    prompt = _tokens(rng, 150)
    # A chunk short enough for the token-by-token form, then two across chunks of 64, next to a
    # decoding sequence.
    chunks = [prompt[:3], prompt[3:83], prompt[83:]]
    chunked, whole = paged_runner(model, block_size=4), paged_runner(model, block_size=4)
    other = _tokens(rng, 6)
    chunked.step({"other": other})
    seen: list[int] = []
    for chunk in chunks:
        token = _tokens(rng, 1)
        logits, _ = chunked.step({"p": chunk, "other": token})
        seen += chunk
        other += token
        assert_close(logits["p"], reference_logits(hf, seen)[-len(chunk) :], f"chunk of {len(chunk)}")
        assert_close(logits["other"], reference_logits(hf, other)[-1:], "decode beside the chunks")
    whole.step({"p": prompt})
    _assert_states_close(_slot_states(chunked, "p"), _slot_states(whole, "p"), "chunked vs whole prefill")
    token = _tokens(rng, 1)
    by_chunks, _ = chunked.step({"p": token})
    at_once, _ = whole.step({"p": token})
    torch.testing.assert_close(by_chunks["p"], at_once["p"], rtol=0, atol=1e-4)
    assert_close(by_chunks["p"], reference_logits(hf, prompt + token)[-1:], "decode after chunked prefill")


@pytest.mark.parametrize("accepted", [0, 2, 4])
def test_speculative_rows_roll_back_to_the_accepted_state(accepted, model, hf, paged_runner):
    rng = random.Random(2 + accepted)
    prompt, other = _tokens(rng, 12), _tokens(rng, 20)
    row = _tokens(rng, 5)  # the last accepted token and 4 drafts
    runner = paged_runner(model, block_size=4)
    runner.step({"a": prompt, "b": other})
    before = _slot_states(runner, "a")

    # One verification row that keeps its 5 positions, beside a plain decode and a new prompt.
    fresh = _tokens(rng, 9)
    decode = _tokens(rng, 1)
    logits, _ = runner.step({"a": row, "b": decode, "c": fresh}, keep_positions={"a": len(row)})
    assert_close(logits["a"], reference_logits(hf, prompt + row)[-len(row) :], "verification row")
    assert_close(logits["b"], reference_logits(hf, other + decode)[-1:], "decode beside the verification")
    assert_close(logits["c"], reference_logits(hf, fresh), "prefill beside the verification")
    _assert_states_close(_slot_states(runner, "a"), before, "committed state during verification")

    runner.commit({"a": accepted})
    kept = prompt + row[: accepted + 1]
    sequential = paged_runner(model, block_size=4)
    sequential.step({"a": prompt})
    for token in row[: accepted + 1]:
        sequential.step({"a": [token]})
    _assert_states_close(_slot_states(runner, "a"), _slot_states(sequential, "a"), f"committed after {accepted}")

    token = _tokens(rng, 1)
    logits, _ = runner.step({"a": token})
    expected, _ = sequential.step({"a": token})
    torch.testing.assert_close(logits["a"], expected["a"], rtol=0, atol=1e-4)
    assert_close(logits["a"], reference_logits(hf, kept + token)[-1:], "decode after the rollback")


def test_a_reused_slot_starts_from_zeros(model, hf, paged_runner):
    runner = paged_runner(model, block_size=4)
    runner.step({"a": list(range(40, 60))})
    slot = runner.states.acquire("a")
    runner.states.release("a")
    assert runner.states.acquire("b") == slot  # holds a's state now
    prompt = list(range(100, 107))
    logits, _ = runner.step({"b": prompt})
    assert_close(logits["b"], reference_logits(hf, prompt), "prefill into a used slot")


def test_a_forward_without_state_slots_is_refused(model, paged_runner):
    runner = paged_runner(model)
    metadata = runner.metadata({"a": [1, 2, 3]})
    metadata.state = None
    with torch.inference_mode(), pytest.raises(ValueError, match="attn_metadata.state"):
        model(torch.tensor([1, 2, 3]), metadata.positions, runner.caches, metadata)


def test_captured_states_and_inputs_embeds(model, hf, paged_runner):
    prompts = {"a": [3, 14, 15, 92, 65, 35], "b": [8, 9]}
    _, captured = paged_runner(model).step(prompts, capture_layers=(4, 0, 1, 2, 3))
    for seq, tokens in prompts.items():
        with torch.no_grad():
            states = hf(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        for layer in range(4):
            torch.testing.assert_close(captured[layer][seq], states[layer][0], rtol=0, atol=1e-4)
        with torch.no_grad():  # transformers' last entry is normed
            torch.testing.assert_close(model.model.norm(captured[4][seq]), states[4][0], rtol=0, atol=1e-4)

    tokens = [5, 6, 7, 8, 9]
    by_ids, by_embeds = paged_runner(model), paged_runner(model)
    with torch.inference_mode():
        ids = torch.tensor(tokens)
        metadata = by_ids.metadata({"a": tokens})
        expected = model(ids, metadata.positions, by_ids.caches, metadata)
        metadata = by_embeds.metadata({"a": tokens})
        got = model(None, metadata.positions, by_embeds.caches, metadata, inputs_embeds=model.embed_tokens(ids))
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_bfloat16_model_tracks_float32(checkpoint, model, paged_runner):
    bf16 = load_model(checkpoint, torch.bfloat16, "cpu").model
    runner = paged_runner(bf16)
    assert runner.states.layers[0].conv.dtype == torch.bfloat16
    assert runner.states.layers[0].recurrent.dtype == torch.float32
    prompt = {"a": list(range(100, 130)), "b": [7, 8, 9]}
    low, _ = runner.step(prompt)
    ref, _ = paged_runner(model).step(prompt)
    for seq in prompt:
        # bf16 keeps ~3 significant digits and may route a near-tied token to other experts.
        row_errors = (low[seq] - ref[seq]).abs().amax(dim=-1)
        assert (row_errors < 0.5).float().mean().item() >= 0.8, row_errors


# ---- loading --------------------------------------------------------------------------------


def test_stacked_experts_load_like_per_expert_ones(checkpoint, model, hf, tmp_path, paged_runner):
    # transformers keeps experts as 3-D tensors and writes them so without save_original_format.
    hf.save_pretrained(tmp_path, save_original_format=False)
    names = load_file(tmp_path / "model.safetensors").keys()
    assert "model.layers.1.mlp.experts.gate_up_proj" in names
    assert not any(".mlp.experts.0." in name for name in names)
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in load_file(checkpoint / "model.safetensors")
    stacked = load_model(tmp_path, torch.float32, "cpu").model
    prompt = {"a": [9, 8, 7, 6, 5, 4]}
    got, _ = paged_runner(stacked).step(prompt)
    expected, _ = paged_runner(model).step(prompt)
    torch.testing.assert_close(got["a"], expected["a"], rtol=0, atol=0)


def _layer_tensors(tensors: dict[str, torch.Tensor], prefix: str) -> dict[str, torch.Tensor]:
    return {name.removeprefix(prefix): t for name, t in tensors.items() if name.startswith(prefix)}


@pytest.fixture(scope="module")
def with_mtp(checkpoint, tmp_path_factory) -> Path:
    """The checkpoint plus a Qwen3-Next MTP module under ``mtp.``: a copy of the last (full
    attention, MoE) layer as ``mtp.layers.0`` and the module's own projection and norms."""
    folder = tmp_path_factory.mktemp("qwen3-next-mtp")
    for item in checkpoint.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    hidden = tensors["model.norm.weight"].shape[0]
    mtp = {f"layers.0.{name}": t.clone() for name, t in _layer_tensors(tensors, f"model.layers.{NUM_LAYERS - 1}.").items()}
    mtp["fc.weight"] = torch.randn(hidden, 2 * hidden)
    for norm in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        mtp[f"{norm}.weight"] = torch.randn(hidden) * 0.1
    tensors.update({f"mtp.{name}": t for name, t in mtp.items()})
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_the_mtp_tensors_are_never_the_models(with_mtp, model, paged_runner):
    prompt = {"a": [9, 8, 7, 6, 5, 4]}
    expected, _ = paged_runner(model).step(prompt)
    for claimed in ((), ("mtp.",)):
        loaded = load_model(with_mtp, torch.float32, "cpu", claimed_prefixes=claimed).model
        got, _ = paged_runner(loaded).step(prompt)
        torch.testing.assert_close(got["a"], expected["a"], rtol=0, atol=0)


def test_the_mtp_block_builds_from_the_config_and_equals_the_models_layer(with_mtp, model, paged_runner):
    config = Qwen3NextLayerConfig.from_hf_config(model.hf_config)
    layer = Qwen3NextAttentionLayer(config, moe=True)
    source = model.model.layers[NUM_LAYERS - 1]
    assert layer.kv_spec() == model.kv_cache_specs()[-1]
    tensors = _layer_tensors(load_file(with_mtp / "model.safetensors"), "mtp.layers.0.")
    load_named_weights(layer, tensors.items(), config.fused_projections())
    prepack_linears(layer)  # as load_head_checkpoint does, so both take the same matmul paths

    runner = paged_runner(model)
    metadata = runner.metadata({"a": [1, 2, 3, 4, 5], "b": [6, 7]})
    num_blocks = runner.caches[0][0].shape[0]
    caches = allocate_kv_cache([layer.kv_spec()] * 2, num_blocks, runner.block_size, torch.float32, "cpu")
    hidden = torch.randn(7, config.hidden_size)
    cos, sin = RotaryEmbedding(config.rope).cos_sin(metadata.positions, hidden.dtype)
    with torch.inference_mode():
        expected = source(hidden, cos, sin, caches[0], metadata)
        got = layer(hidden, cos, sin, caches[1], metadata)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_unknown_layer_types_are_refused(model):
    config = model.hf_config.__class__.from_dict(model.hf_config.to_dict())
    config.layer_types = ["linear_attention", "sliding_attention", "linear_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer_types \['sliding_attention'\] are not supported"):
        Qwen3NextLayerConfig.from_hf_config(config)


# ---- building blocks ------------------------------------------------------------------------


def test_delta_rule_forms_agree_with_transformers():
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

    generator = torch.Generator().manual_seed(0)
    length, heads, k_dim, v_dim = 45, 3, 8, 5
    q, k = torch.randn(2, length, heads, k_dim, generator=generator).unbind(0)
    v = torch.randn(length, heads, v_dim, generator=generator)
    g = -torch.rand(length, heads, generator=generator)
    beta = torch.rand(length, heads, generator=generator)
    state = torch.randn(heads, k_dim, v_dim, generator=generator)
    ref, ref_state = torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=state[None],
        output_final_state=True, use_qk_l2norm_in_kernel=True,
    )
    q, k = l2_normalize(q) * k_dim**-0.5, l2_normalize(k)
    out, states = recurrent_gated_delta_rule(q[None], k[None], v[None], g[None], beta[None], state[None])
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=1e-5)
    torch.testing.assert_close(states[-1][0], ref_state[0], rtol=0, atol=1e-5)
    for chunk_size in (64, 16, 7, 1):  # one chunk, several, a ragged last one, one token each
        out, final = chunked_gated_delta_rule(q, k, v, g, beta, state, chunk_size)
        torch.testing.assert_close(out, ref[0], rtol=0, atol=1e-5, msg=f"chunk size {chunk_size}")
        torch.testing.assert_close(final, ref_state[0], rtol=0, atol=1e-5, msg=f"chunk size {chunk_size}")


def test_padding_leaves_a_finished_rows_state_alone():
    generator = torch.Generator().manual_seed(1)
    q, k = l2_normalize(torch.randn(2, 1, 4, 2, 8, generator=generator)).unbind(0)
    v = torch.randn(1, 4, 2, 8, generator=generator)
    g, beta = -torch.rand(1, 4, 2, generator=generator), torch.rand(1, 4, 2, generator=generator)
    g[:, 2:], beta[:, 2:] = 0, 0
    state = torch.randn(1, 2, 8, 8, generator=generator)
    _, states = recurrent_gated_delta_rule(q, k, v, g, beta, state)
    assert torch.equal(states[3], states[1])


def test_norms_compute_as_the_reference_does():
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm, Qwen3NextRMSNormGated

    generator = torch.Generator().manual_seed(2)
    x, gate = (torch.randn(5, 3, 16, generator=generator).to(torch.bfloat16) for _ in range(2))
    weight = torch.randn(16, generator=generator) * 0.1
    for ours, theirs in ((ZeroCentredRMSNorm(16), Qwen3NextRMSNorm(16)), (GatedRMSNorm(16), Qwen3NextRMSNormGated(16))):
        with torch.no_grad():
            ours.weight.copy_(weight), theirs.weight.copy_(weight)
        ours, theirs = ours.to(torch.bfloat16), theirs.to(torch.bfloat16)
        args = (x,) if isinstance(ours, ZeroCentredRMSNorm) else (x, gate)
        with torch.no_grad():
            assert torch.equal(ours(*args), theirs(*args)), type(ours).__name__
    assert torch.equal(ZeroCentredRMSNorm(4).weight, torch.zeros(4))  # starts as the identity scale


def test_partial_default_rope_matches_transformers(model):
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        Qwen3NextRotaryEmbedding,
        apply_rotary_pos_emb,
    )

    config = model.hf_config
    rope = RopeConfig.from_hf_config(config, config.head_dim)
    assert rope.rotary_dim == int(config.head_dim * 0.25) < config.head_dim
    theirs = Qwen3NextRotaryEmbedding(config)
    torch.testing.assert_close(rope.inv_freq(), theirs.inv_freq, rtol=0, atol=0)

    positions = torch.tensor([0, 3, 17, 250])
    x = torch.randn(4, 2, config.head_dim)
    cos, sin = RotaryEmbedding(rope).cos_sin(positions, x.dtype)
    ref_cos, ref_sin = theirs(x, positions[None])
    # transformers' [batch, heads, tokens, head_dim]
    expected, _ = apply_rotary_pos_emb(x.transpose(0, 1)[None], x.transpose(0, 1)[None], ref_cos, ref_sin)
    torch.testing.assert_close(apply_rotary(x, cos, sin), expected[0].transpose(0, 1), rtol=0, atol=1e-6)


@pytest.mark.parametrize("rope_type", ["linear", "llama3"])
def test_partial_rotation_of_other_rope_types_is_refused(rope_type):
    with pytest.raises(ValueError, match=f"partial rotary embeddings .* not '{rope_type}'"):
        RopeConfig.from_parameters({"rope_type": rope_type, "factor": 2.0, "partial_rotary_factor": 0.5}, 64, 128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_logits_match_transformers(checkpoint, hf, paged_runner):
    model = load_model(checkpoint, torch.float32, "cuda").model
    rng = random.Random(3)
    prompts = {"a": _tokens(rng, 70), "b": _tokens(rng, 3)}
    runner = paged_runner(model, block_size=4)
    logits, _ = runner.step(prompts)
    for seq, tokens in prompts.items():
        assert_close(logits[seq].cpu(), reference_logits(hf, tokens), f"cuda prefill {seq}")
    row, token = _tokens(rng, 4), _tokens(rng, 1)
    logits, _ = runner.step({"a": row, "b": token}, keep_positions={"a": len(row)})
    assert_close(logits["a"].cpu(), reference_logits(hf, prompts["a"] + row)[-len(row) :], "cuda verification")
    assert_close(logits["b"].cpu(), reference_logits(hf, prompts["b"] + token)[-1:], "cuda decode")
    runner.commit({"a": 1})
    token = _tokens(rng, 1)
    logits, _ = runner.step({"a": token})
    assert_close(logits["a"].cpu(), reference_logits(hf, prompts["a"] + row[:2] + token)[-1:], "cuda after rollback")
