"""Block drafters (core's BlockProposer with the dflash and dspark plugins): lossless over layouts,
block sizes, batches, budgets shorter than the block, chunked prefill and preemption; drafts equal a
reference block forward written here from the published layouts; probabilistic drafting follows
the target distribution."""

from __future__ import annotations

import json
import math
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from aphrodite import LLM, SamplingParams
from sonar_core.testing.block_drafters import build_block_drafter
from sonar_core.testing.checkpoints import build_tiny_checkpoint
from sonar_core.testing.losslessness import (
    assert_follows_target_distribution,
    constant_distribution_target,
    greedy_outputs,
    per_position_acceptance,
    probabilistic_llm,
    sampled_output_distances,
)
from sonar_core.testing.plugin_checks import check_drafts_from_states
from sonar_core.testing.prefix_caching import check_followers_find_their_draft_kv
from sonar_core.testing.reference_ops import rms_norm, rope

LAYERS = 4
DRAFTERS = {
    "zlab-b4": ("dflash", dict(layout="zlab", block_size=4)),
    "zlab-b8-two-layers-causal": ("dflash", dict(layout="zlab", block_size=8, num_layers=2, causal=True)),
    "speculators-dflash-reduced-vocab": ("dflash", dict(layout="speculators-dflash", block_size=5, draft_vocab_size=120)),
    "deepspec-vanilla": ("dspark", dict(layout="deepspec", block_size=4, markov_rank=8)),
    "deepspec-gated-b16": ("dspark", dict(layout="deepspec", block_size=16, markov_rank=8, markov_head_type="gated")),
    "speculators-dspark-rnn": (
        "dspark", dict(layout="speculators-dspark", block_size=6, markov_rank=8, markov_head_type="rnn", draft_vocab_size=150),
    ),
}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("block-target"), arch="qwen3", num_layers=LAYERS, head_dim=32)


@pytest.fixture(scope="module")
def drafters(target: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("block-drafters")
    return {name: build_block_drafter(target, root / name, **options) for name, (_, options) in DRAFTERS.items()}


def _prompts(count: int = 8) -> list[list[int]]:
    rng = random.Random(4)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(2, 40))] for _ in range(count)]


@pytest.fixture(scope="module")
def reference(target: Path) -> list[list[int]]:
    return greedy_outputs(target, _prompts(), max_num_seqs=8)[0]


def _config(name: str, drafters: dict[str, Path], depth: int | None = None) -> dict:
    method, options = DRAFTERS[name]
    block = options["block_size"]
    default = block if method == "dspark" else block - 1
    return {"method": method, "model": str(drafters[name]), "num_speculative_tokens": depth or default}


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("batch", [1, 8])
def test_greedy_output_equals_plain_output(name, batch, target, drafters, reference):
    tokens, llm = greedy_outputs(target, _prompts(), _config(name, drafters), max_num_seqs=batch)
    assert tokens == reference
    assert llm.get_spec_decode_metrics().num_draft_tokens > 0


@pytest.mark.parametrize("name", ["zlab-b8-two-layers-causal", "deepspec-gated-b16"])
def test_chunked_prefill_preemption_and_short_budgets_keep_greedy_output(name, target, drafters, reference):
    config = _config(name, drafters)
    assert greedy_outputs(target, _prompts(), config, max_num_seqs=4, max_num_batched_tokens=8)[0] == reference
    # 40 blocks of 4 tokens (target and draft layers, K and V, 2 heads x 32 dims, fp32: 1024 bytes a
    # layer and block): later requests preempt earlier ones.
    layers = LAYERS + DRAFTERS[name][1].get("num_layers", 1)
    tokens, llm = greedy_outputs(
        target, _prompts(), config, max_num_seqs=8, block_size=4, max_model_len=64,
        kv_cache_memory_gb=40 * 1024 * layers / 2**30,
    )
    assert tokens == reference
    assert llm.engine.num_preemptions > 0
    # max_tokens 3: most steps have a budget shorter than the block.
    assert greedy_outputs(target, _prompts(), config, max_tokens=3)[0] == [r[:3] for r in reference]


def test_fewer_drafts_than_the_block_keep_the_trained_block(target, drafters, reference):
    tokens, llm = greedy_outputs(target, _prompts(), _config("zlab-b8-two-layers-causal", drafters, depth=2))
    assert tokens == reference
    assert llm.engine.speculator.capabilities.draft_block_len == 8


# --- the reference block forward ---------------------------------------------------------------


class BlockReference:
    """z-lab's DFlash / DeepSpec's DSpark draft pass, in plain torch from the published layouts:
    context K/V from hidden_norm(fc(states)) without input norm, a block of [anchor, MASK...] whose
    queries see the whole context and (non-causal) the whole block."""

    def __init__(self, drafter: Path, target: Path) -> None:
        self.w = load_file(drafter / "model.safetensors")
        t = load_file(target / "model.safetensors")
        config = json.loads((drafter / "config.json").read_text())
        self.speculators = "speculators_model_type" in config
        layer = config.get("transformer_layer_config", config)
        flags = {**config, **(config.get("dflash_config") or {})}
        self.eps, self.heads, self.kv_heads = layer["rms_norm_eps"], layer["num_attention_heads"], layer["num_key_value_heads"]
        self.head_dim = layer["head_dim"]
        self.theta = (layer.get("rope_parameters") or {}).get("rope_theta", layer.get("rope_theta", 10000.0))
        self.num_layers = layer["num_hidden_layers"]
        self.block = flags["block_size"]
        self.mask = flags["mask_token_id"]
        self.causal = bool(flags.get("causal", False))
        self.anchored = bool(config.get("sample_from_anchor", "markov_rank" in config and not self.speculators))
        self.embed = self.w.get("embed_tokens.weight", t["model.embed_tokens.weight"])
        self.lm_head = self.w.get("lm_head.weight", t["lm_head.weight"])
        self.target_ids = torch.arange(len(self.w["d2t"])) + self.w["d2t"] if "d2t" in self.w else None
        self.markov = config.get("markov_head_type") if config.get("markov_rank") else None

    def _attention(self, i: int, queries: torch.Tensor, context: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        w, p, d = self.w, f"layers.{i}.self_attn.", self.head_dim
        ctx_len = len(context)

        def heads(x, name, count):
            return (x @ w[f"{p}{name}_proj.weight"].T).view(len(x), count, d)

        q = rms_norm(heads(queries, "q", self.heads), w[f"{p}q_norm.weight"], self.eps)
        k = rms_norm(torch.cat((heads(context, "k", self.kv_heads), heads(queries, "k", self.kv_heads))), w[f"{p}k_norm.weight"], self.eps)
        v = torch.cat((heads(context, "v", self.kv_heads), heads(queries, "v", self.kv_heads)))
        q, k = rope(q, positions[ctx_len:], self.theta), rope(k, positions, self.theta)
        group = self.heads // self.kv_heads
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(d)
        if self.causal:
            visible = torch.ones(len(queries), len(k), dtype=torch.bool)
            visible[:, ctx_len:] = torch.ones(len(queries), len(queries), dtype=torch.bool).tril()
            scores = scores.masked_fill(~visible, float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(len(queries), -1)
        return out @ w[f"{p}o_proj.weight"].T

    def drafts(self, token_ids: list[int], states: torch.Tensor, depth: int) -> list[int]:
        """Greedy drafts after ``token_ids`` from the target states of positions 0..len-2."""
        w = self.w
        context = rms_norm(states @ w["fc.weight"].T, w["hidden_norm.weight"], self.eps)
        start = len(token_ids) - 1
        positions = torch.arange(start + self.block)
        x = self.embed[torch.tensor([token_ids[-1]] + [self.mask] * (self.block - 1))]
        for i in range(self.num_layers):
            h = rms_norm(x, w[f"layers.{i}.input_layernorm.weight"], self.eps)
            x = x + self._attention(i, h, context, positions)
            h = rms_norm(x, w[f"layers.{i}.post_attention_layernorm.weight"], self.eps)
            gate, up = h @ w[f"layers.{i}.mlp.gate_proj.weight"].T, h @ w[f"layers.{i}.mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(gate) * up) @ w[f"layers.{i}.mlp.down_proj.weight"].T
        slots = rms_norm(x, w["norm.weight"], self.eps)[0 if self.anchored else 1 :]
        drafts, prev, state = [], token_ids[-1], None
        for k in range(depth):
            logits = slots[k] @ self.lm_head.T
            if self.markov:
                bias, state = self._markov(prev, slots[k], state)
                logits = logits + bias
            draft = int(logits.argmax())
            prev = int(self.target_ids[draft]) if self.target_ids is not None else draft
            drafts.append(prev)
        return drafts

    def _markov(self, prev: int, hidden: torch.Tensor, state: torch.Tensor | None):
        w, e = self.w, self.w["markov_head.markov_w1.weight"][prev]
        w2 = w["markov_head.markov_w2.weight"]
        if self.markov == "vanilla":
            return w2 @ e, None
        if self.markov == "gated":
            gate = torch.sigmoid(w["markov_head.gate_proj.weight"] @ torch.cat((hidden, e)) + w["markov_head.gate_proj.bias"])
            return w2 @ (gate * e), None
        state = torch.zeros_like(e) if state is None else state
        a, c, o = (w["markov_head.joint_proj.weight"] @ torch.cat((state, e, hidden)) + w["markov_head.joint_proj.bias"]).chunk(3)
        state = torch.sigmoid(a) * state + (1 - torch.sigmoid(a)) * torch.tanh(c)
        return w2 @ torch.tanh(o), state


@pytest.mark.parametrize("name", list(DRAFTERS))
@pytest.mark.parametrize("chunked", [False, True], ids=["whole-prefill", "chunked-prefill"])
def test_drafts_equal_the_published_block_forward(name, chunked, target, drafters):
    extra = {"max_num_batched_tokens": 8, "max_num_seqs": 4} if chunked else {}
    llm = LLM(model=str(target), dtype="float32", device="cpu", speculative_config=_config(name, drafters), **extra)
    reference = BlockReference(drafters[name], target)
    assert check_drafts_from_states(llm, _prompts(6), lambda hidden: hidden.aux, reference.drafts) > 10


# --- probabilistic drafting --------------------------------------------------------------------


@pytest.fixture(scope="module")
def constant_target(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return constant_distribution_target(target, tmp_path_factory.mktemp("block-constant"))


def _matching_drafter(target: Path, out: Path, noise: float) -> Path:
    """A z-lab drafter whose layers add nothing and whose norm is the target's (plus noise): every
    slot drafts from exactly (or nearly) the target's distribution."""
    build_block_drafter(target, out, layout="zlab", block_size=4)
    weights = load_file(out / "model.safetensors")
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    norm = load_file(target / "model.safetensors")["model.norm.weight"]
    generator = torch.Generator().manual_seed(3)
    weights["norm.weight"] = norm * (1 + noise * torch.randn(norm.shape, generator=generator))
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def test_a_drafter_of_the_targets_distribution_is_always_accepted(constant_target, tmp_path):
    drafter = _matching_drafter(constant_target, tmp_path / "d", 0.0)
    llm = probabilistic_llm(constant_target, {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 3})
    assert per_position_acceptance(llm, depth=3) == [1.0, 1.0, 1.0]


def test_sampled_output_follows_the_target_distribution(constant_target, tmp_path):
    drafter = _matching_drafter(constant_target, tmp_path / "d", 0.5)
    llm = probabilistic_llm(constant_target, {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 2})
    results = sampled_output_distances(llm)
    assert 0.2 < llm.get_spec_decode_metrics().acceptance_rate < 0.9
    assert_follows_target_distribution(results)


def test_markov_drafting_follows_the_target_distribution(constant_target, tmp_path):
    """DSpark's Markov bias shifts each slot's distribution by the token drafted before it: the
    probabilities handed to the verifier must be those of the biased distribution."""
    drafter = build_block_drafter(constant_target, tmp_path / "dspark", layout="deepspec", block_size=3, markov_rank=4,
                                  init_std=0.05)
    weights = load_file(drafter / "model.safetensors")
    target_weights = load_file(constant_target / "model.safetensors")
    weights["embed_tokens.weight"] = target_weights["model.embed_tokens.weight"]
    weights["lm_head.weight"] = target_weights["lm_head.weight"]
    weights["norm.weight"] = target_weights["model.norm.weight"]
    for name in list(weights):
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            weights[name] = torch.zeros_like(weights[name])
    generator = torch.Generator().manual_seed(6)
    for name, scale in (("markov_head.markov_w1.weight", 1.0), ("markov_head.markov_w2.weight", 0.5)):
        weights[name] = torch.randn(weights[name].shape, generator=generator) * scale
    save_file(weights, str(drafter / "model.safetensors"), metadata={"format": "pt"})
    llm = probabilistic_llm(constant_target, {"method": "dspark", "model": str(drafter), "num_speculative_tokens": 3})
    results = sampled_output_distances(llm)
    assert 0.1 < llm.get_spec_decode_metrics().acceptance_rate < 0.95
    assert_follows_target_distribution(results)


@pytest.mark.parametrize("first_tokens", [12, 1], ids=["cached-while-running", "cached-as-it-ends"])
@pytest.mark.parametrize("name", ["zlab-b4", "deepspec-vanilla"])
def test_prefix_caching_keeps_the_context_a_request_would_write(name, first_tokens, target, drafters):
    """A block drafter's context KV of a position comes from the target's states there alone and is
    written in the step that computes it (the step that ends a request included): a request that
    starts after another one's cached blocks finds the context it would have written."""
    engines = {
        caching: LLM(model=str(target), dtype="float32", device="cpu", block_size=4, enable_prefix_caching=caching,
                     speculative_config=_config(name, drafters))
        for caching in (False, True)
    }
    assert engines[True].engine.block_manager.lookahead == 0
    rng = random.Random(6)
    prefix = [rng.randrange(3, 500) for _ in range(18)]
    greedy = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    followers = [(prefix + [11], 16), (prefix + [12, 13, 14, 15, 16], 16)]
    check_followers_find_their_draft_kv(engines[True], engines[False], prefix + [7, 8, 9], first_tokens, followers, greedy)
