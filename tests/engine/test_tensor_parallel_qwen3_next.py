"""Qwen3-Next split over tensor-parallel ranks (CPU, gloo): greedy output at two and four ranks
equals one rank's token for token in float32, plain and with MTP speculation, over chunked
prefills and batches whose recurrent states are committed after verification; each rank holds its
share of the heads, experts and state, and runs one all-reduce per token mixer and per MLP or MoE;
the MTP layers stay whole on the driver."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from sonar_core.kv import RecurrentStateCache, StateBatch, allocate_kv_cache
from sonar_core.layers.attention import AttentionMetadata
from sonar_core.layers.linear import RowParallelLinear
from sonar_core.layers.moe import split_stacked_experts
from sonar_core.layers.tensor_parallel import TensorParallel, tensor_parallel_scope
from sonar_core.models.loader import load_model, read_hf_config
from sonar_core.models.qwen3_next import Qwen3NextLayerConfig
from sonar_core.models.sharding import shard_weights
from sonar_core.testing.layer_tensors import copy_with_tensors
from sonar_core.testing.losslessness import greedy_outputs, random_prompts
from sonar_core.testing.mtp_layers import build_qwen3_next_target

# Short prompts, one that takes four chunked-prefill steps of BATCH_TOKENS, and repeating ones;
# more prompts than MAX_SEQS, so batches mix prefill chunks, decodes and verification rows.
BATCH_TOKENS = 16
MAX_SEQS = 3
PROMPTS = (
    random_prompts(3, seed=23, vocab=500, max_len=24)
    + [[3 + (7 * i) % 490 for i in range(4 * BATCH_TOKENS - 5)]]
    + [[11, 12, 13, 14, 15] * 4]
)
ENGINE = {"max_num_seqs": MAX_SEQS, "max_num_batched_tokens": BATCH_TOKENS, "max_tokens": 16}
# Every chain at full depth, so that verification rolls the states back to every position.
MTP = {"method": "mtp", "num_speculative_tokens": 3, "draft_stop_confidence": 0}
# Four ranks need four KV heads and four linear-attention key heads (each serving two value heads).
WIDE = {"num_kv_heads": 4, "config_overrides": {"linear_num_key_heads": 4, "linear_num_value_heads": 8}}


def predictable(target: Path, out: Path, scale: float = 0.01) -> Path:
    """A copy of ``target`` whose MTP layer drafts what the target will say more often than not.

    Every block's output projection (the MTP block's too) is scaled by ``scale``: the residual
    stream stays near the current token's embedding, so the next token is nearly a function of the
    current one, yet the blocks still change it often. The MTP layer's ``fc`` passes the embedding
    of the token after the position (plus ``scale`` times its hidden-state half) and its norms
    rescale it as the target's final norm does: its draft is that function of the token.
    """
    tensors = load_file(target / "model.safetensors")
    changed = {
        name: tensor * scale
        for name, tensor in tensors.items()
        if name.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight"))
    }
    fc = tensors["mtp.fc.weight"]
    hidden = fc.shape[0]
    changed["mtp.fc.weight"] = torch.cat((torch.eye(hidden), fc[:, hidden:] * scale), dim=1)
    changed["mtp.pre_fc_norm_embedding.weight"] = tensors["model.norm.weight"]
    changed["mtp.norm.weight"] = torch.zeros(hidden)
    return copy_with_tensors(target, out, changed, {})


def split_outputs(target: Path, size: int, speculative_config: dict[str, Any] | None = None,
                  prompts: list[list[int]] = PROMPTS) -> tuple[list[list[int]], Any]:
    """Greedy outputs at ``size`` ranks; the engine is closed before they are returned."""
    tokens, llm = greedy_outputs(target, prompts, speculative_config, tensor_parallel_size=size, **ENGINE)
    llm.engine.close()
    return tokens, llm


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_qwen3_next_target(tmp_path_factory.mktemp("tp-qwen3-next") / "t", num_layers=4)


@pytest.fixture(scope="module")
def drafted(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return predictable(target, tmp_path_factory.mktemp("tp-qwen3-next-drafted") / "t")


# ------------------------------------------------------------------------------- two ranks
def test_two_ranks_decode_like_one(target: Path):
    plain, _ = greedy_outputs(target, PROMPTS, **ENGINE)
    split, llm = split_outputs(target, 2)
    assert split == plain
    # Each rank holds half the KV heads and half the linear-attention state.
    assert llm.engine.model.kv_cache_specs()[0].num_kv_heads == 1
    assert llm.engine.model.state_specs()[0].recurrent_shape == (2, 16, 16)


def test_mtp_over_two_ranks_is_lossless_and_drafts_on_the_driver(drafted: Path):
    plain, _ = greedy_outputs(drafted, PROMPTS, **ENGINE)
    split, llm = split_outputs(drafted, 2, MTP)
    assert split == plain
    metrics = llm.get_spec_decode_metrics()
    # Some drafts rejected, some accepted at every depth: states roll back to every position.
    assert 0 < metrics.num_accepted_tokens < metrics.num_draft_tokens
    assert all(metrics.num_accepted_tokens_per_pos)
    head = llm.engine.speculator.proposer.head
    assert not any(isinstance(module, RowParallelLinear) for module in head.modules())
    assert all(module.parallel.size == 1 for module in head.modules() if hasattr(module, "parallel"))
    assert llm.engine.speculator.capabilities.kv_layers[0].num_kv_heads == 2  # the MTP layer's, whole


# ---------------------------------------------------------------- four key heads, four ranks
@pytest.fixture(scope="module")
def wide(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tp-qwen3-next-wide")
    return predictable(build_qwen3_next_target(folder / "base", num_layers=4, **WIDE), folder / "t")


def test_a_rank_can_hold_several_key_head_groups(wide: Path):
    plain, _ = greedy_outputs(wide, PROMPTS, **ENGINE)
    split, llm = split_outputs(wide, 2)
    assert split == plain
    assert llm.engine.model.state_specs()[0].recurrent_shape == (4, 16, 16)


def test_the_guides_mtp_example_over_four_ranks(wide: Path):
    """``tensor_parallel_size=4`` with ``{"method": "mtp", "num_speculative_tokens": 3}``, tiny."""
    prompts = PROMPTS[2:4]
    plain, _ = greedy_outputs(wide, prompts, **ENGINE)
    split, llm = split_outputs(wide, 4, MTP, prompts)
    assert split == plain
    assert llm.get_spec_decode_metrics().num_accepted_tokens > 0
    assert llm.engine.model.state_specs()[0].recurrent_shape == (2, 16, 16)


# ------------------------------------------------------------------------- one rank's share
@dataclass(frozen=True)
class CountingParallel(TensorParallel):
    """A rank of a split in this process alone: all-reduces are recorded, not summed."""

    reduced: list[tuple[int, ...]] = field(default_factory=list)

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        self.reduced.append(tuple(tensor.shape))
        return tensor


def test_a_rank_holds_whole_key_head_groups_and_its_share_of_the_state(target: Path):
    parallel = CountingParallel(rank=1, size=2)
    with tensor_parallel_scope(parallel):
        model = load_model(target, torch.float32, "cpu").model
    tensors = load_file(target / "model.safetensors")
    whole = Qwen3NextLayerConfig.from_hf_config(model.hf_config)
    assert (whole.linear.num_k_heads, whole.linear.num_v_heads) == (2, 4)

    # Rank 1 of 2: key head 1 with value heads 2-3, the state of those.
    (spec, _) = model.state_specs()
    assert spec.recurrent_shape == (2, 16, 16)
    assert spec.conv_shape == (2 * 16 + 2 * 16, 3)
    assert model.kv_cache_specs()[0].num_kv_heads == 1
    layer = model.model.layers[0].linear_attn
    qkvz = tensors["model.layers.0.linear_attn.in_proj_qkvz.weight"]
    ba = tensors["model.layers.0.linear_attn.in_proj_ba.weight"]
    assert torch.equal(layer.in_proj.weight, torch.cat((qkvz[qkvz.shape[0] // 2 :], ba[4:])))
    conv = tensors["model.layers.0.linear_attn.conv1d.weight"]  # q (32 channels), k (32), v (64)
    assert torch.equal(layer.conv1d.weight, torch.cat((conv[16:32], conv[48:64], conv[96:128])))
    assert torch.equal(layer.A_log, tensors["model.layers.0.linear_attn.A_log"][2:])
    assert torch.equal(layer.out_proj.weight, tensors["model.layers.0.linear_attn.out_proj.weight"][:, 32:])
    # Full attention: heads 2-3 (query and gate rows of each), KV head 1.
    attention = model.model.layers[1].self_attn
    assert torch.equal(attention.qkv_proj.weight[:64], tensors["model.layers.1.self_attn.q_proj.weight"][64:])
    # The MoE: routers and the shared-expert gate whole, every expert's columns halved.
    moe = model.model.layers[1].mlp
    assert moe.gate.weight.shape == (4, 64) and moe.shared_expert_gate.weight.shape == (1, 64)
    assert moe.experts[0].gate_up_proj.weight.shape == (2 * 16, 64)
    assert moe.shared_expert.down_proj.weight.shape == (64, 24)

    # One all-reduce per token mixer and one per MoE, of the whole hidden width.
    kv = allocate_kv_cache(model.kv_cache_specs(), 1, 16, torch.float32, torch.device("cpu"))
    states = RecurrentStateCache(model.state_specs(), 1, 1, torch.float32, torch.device("cpu"))
    metadata = AttentionMetadata.build([6], [6], [[0]], 16, torch.device("cpu"))
    metadata.state = StateBatch(states, [0], [False], [0])
    with torch.inference_mode():
        model(torch.arange(3, 9), metadata.positions, kv, metadata)
    assert parallel.reduced == [(6, 64)] * 2 * len(model.model.layers)


def test_stacked_experts_split_like_per_expert_ones(target: Path):
    """transformers' 3-D expert tensors are cut to the same shares as the per-expert ones."""
    tensors = load_file(target / "model.safetensors")
    prefix = "model.layers.1.mlp.experts."
    per_expert = {name: tensor for name, tensor in tensors.items() if name.startswith(prefix)}
    def stack(*projections: str) -> torch.Tensor:
        rows = [torch.cat([per_expert[f"{prefix}{e}.{p}.weight"] for p in projections]) for e in range(4)]
        return torch.stack(rows)

    stacked = {
        f"{prefix}gate_up_proj": stack("gate_proj", "up_proj"),
        f"{prefix}down_proj": stack("down_proj"),
    }
    rules = Qwen3NextLayerConfig.from_hf_config(read_hf_config(target)[1]).shard_rules()
    for rank in (0, 1):
        parallel = TensorParallel(rank=rank, size=2)
        got = dict(split_stacked_experts(shard_weights(stacked.items(), rules, parallel)))
        expected = dict(shard_weights(per_expert.items(), rules, parallel))
        assert got.keys() == expected.keys()
        for name, tensor in expected.items():
            assert tensor.shape[1 if name.endswith("down_proj.weight") else 0] == 16
            assert torch.equal(got[name], tensor), name
