"""Mixture of experts with shared experts: DeepSeek-V3's group-limited routing and the softmax
routing of the Qwen MoE families (Qwen3-Next).

Routing (in float32, whatever the model's dtype, as the DeepSeek reference computes it), with
``scoring_func="sigmoid"`` (DeepSeek-V3):

1. ``scores = sigmoid(gate(x))``, one per routed expert;
2. selection only: ``choice = scores + e_score_correction_bias``; experts are split into ``n_group``
   groups, a group scores the sum of its two best ``choice`` values, the ``topk_group`` best groups
   stay eligible and the ``num_experts_per_tok`` best eligible experts are picked;
3. the weights are the picked experts' *uncorrected* ``scores``, normalised to sum 1 when
   ``norm_topk_prob``, then multiplied by ``routed_scaling_factor``.

With ``scoring_func="softmax"`` (Qwen) the scores are ``softmax(gate(x))`` over all experts, the
``num_experts_per_tok`` best are picked (no correction bias, no groups) and weighted by their
scores, normalised when ``norm_topk_prob``. Qwen's reference forms the router logits in the
model's dtype; here they are float32 as well, so a bf16 token whose best experts nearly tie may
pick another one than transformers does.

``y = shared(x) + sum_e weight_e * expert_e(x)``, where ``shared`` is DeepSeek's ungated
``shared_experts`` block or Qwen's ``shared_expert`` scaled by ``sigmoid(shared_expert_gate(x))``.

Split over tensor-parallel ranks (:meth:`MoEConfig.shard`), every expert and shared expert keeps
its rank's share of the intermediate columns, while the router and the shared-expert gate stay
whole: each rank routes alike, and since ``y`` is linear in every block's down projection, the
rank's partial outputs of all blocks are summed first and all-reduced once per MoE, not once per
expert.

Dispatch runs only the experts that received tokens: the (token, expert) pairs are sorted by
expert once, each hit expert multiplies the rows of its tokens in one batch, and the pairs' outputs
are summed per token with their weights (in float32). At decode that is ``num_experts_per_tok``
small matmuls, with weights prepacked like every other projection.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from sonar_core.layers.decoder import DecoderLayerConfig, GatedMLP
from sonar_core.layers.linear import Linear
from sonar_core.layers.tensor_parallel import TensorParallel
from sonar_core.layers.tensor_parallel import current as current_tensor_parallel

SCORING_FUNCS = ("sigmoid", "softmax")


@dataclass(frozen=True)
class MoEConfig:
    """Shape and routing rule of one MoE block."""

    hidden_size: int
    moe_intermediate_size: int  # per routed expert; a shared expert block is n_shared times wider
    num_experts: int
    num_experts_per_tok: int
    num_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    hidden_act: str = "silu"
    scoring_func: str = "sigmoid"  # see the module docstring; "softmax" has no correction bias
    # Qwen's gated shared expert (``shared_expert`` and ``shared_expert_gate``) of this width; 0:
    # none. DeepSeek's ungated ``shared_experts`` come from num_shared_experts instead.
    gated_shared_expert_size: int = 0

    def __post_init__(self) -> None:
        if self.scoring_func not in SCORING_FUNCS:
            raise ValueError(
                f"MoE: scoring_func {self.scoring_func!r} is not supported (supported: {', '.join(SCORING_FUNCS)})"
            )
        if self.num_experts <= 0 or self.n_group <= 0 or self.num_experts % self.n_group:
            raise ValueError(
                f"MoE: n_routed_experts ({self.num_experts}) must be a positive multiple of n_group ({self.n_group})"
            )
        if self.num_experts // self.n_group < 2:
            raise ValueError(
                f"MoE: each of the n_group={self.n_group} expert groups needs at least 2 experts (a group "
                f"scores its two best), got {self.num_experts // self.n_group}"
            )
        if not 0 < self.topk_group <= self.n_group:
            raise ValueError(f"MoE: topk_group ({self.topk_group}) must be in 1..n_group ({self.n_group})")
        eligible = self.topk_group * (self.num_experts // self.n_group)
        if not 0 < self.num_experts_per_tok <= eligible:
            raise ValueError(
                f"MoE: num_experts_per_tok ({self.num_experts_per_tok}) must be in 1..{eligible} (the experts "
                f"of topk_group={self.topk_group} groups)"
            )

    def shard(self, parallel: TensorParallel) -> MoEConfig:
        """The block one rank builds: its share of every expert's (and shared expert's) columns."""
        return parallel.split_fields(self, "moe_intermediate_size", "gated_shared_expert_size")

    @classmethod
    def from_hf_config(cls, hf_config: Any) -> MoEConfig:
        """Read a DeepSeek-V3-style config; refuses the other routing rules DeepSeek configs can name."""
        scoring = getattr(hf_config, "scoring_func", "sigmoid")
        topk_method = getattr(hf_config, "topk_method", "noaux_tc")
        if scoring != "sigmoid" or topk_method != "noaux_tc":
            raise ValueError(
                f"MoE routing scoring_func={scoring!r}, topk_method={topk_method!r} is not supported "
                "(supported: DeepSeek-V3's sigmoid / noaux_tc)"
            )
        return cls(
            hidden_size=int(hf_config.hidden_size),
            moe_intermediate_size=int(hf_config.moe_intermediate_size),
            num_experts=int(hf_config.n_routed_experts),
            num_experts_per_tok=int(hf_config.num_experts_per_tok),
            num_shared_experts=int(getattr(hf_config, "n_shared_experts", None) or 0),
            n_group=int(getattr(hf_config, "n_group", None) or 1),
            topk_group=int(getattr(hf_config, "topk_group", None) or 1),
            norm_topk_prob=bool(getattr(hf_config, "norm_topk_prob", True)),
            routed_scaling_factor=float(getattr(hf_config, "routed_scaling_factor", 1.0)),
            hidden_act=hf_config.hidden_act,
        )

    @classmethod
    def from_qwen_config(cls, hf_config: Any) -> MoEConfig:
        """Read a Qwen-MoE-style config (``num_experts``, ``shared_expert_intermediate_size``):
        softmax routing over all experts and one gated shared expert."""
        return cls(
            hidden_size=int(hf_config.hidden_size),
            moe_intermediate_size=int(hf_config.moe_intermediate_size),
            num_experts=int(hf_config.num_experts),
            num_experts_per_tok=int(hf_config.num_experts_per_tok),
            num_shared_experts=0,
            n_group=1,
            topk_group=1,
            norm_topk_prob=bool(hf_config.norm_topk_prob),
            routed_scaling_factor=1.0,
            hidden_act=hf_config.hidden_act,
            scoring_func="softmax",
            gated_shared_expert_size=int(getattr(hf_config, "shared_expert_intermediate_size", None) or 0),
        )


def gated_mlp(hidden_size: int, intermediate_size: int, hidden_act: str, reduce: bool = True) -> GatedMLP:
    """A ``down(act(gate(x)) * up(x))`` block of the given widths (GatedMLP reads only the MLP
    fields of its layer config); ``reduce=False``: its output is the rank's partial sum (see
    :class:`GatedMLP`)."""
    config = DecoderLayerConfig(
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_heads=1,
        num_kv_heads=1,
        head_dim=1,
        hidden_act=hidden_act,
    )
    return GatedMLP(config, reduce)


def mlp_fused_projections(prefix: str, intermediate_size: int) -> dict[str, tuple[str, int, int]]:
    """``{prefix}gate_proj`` and ``{prefix}up_proj`` stacked into ``{prefix}gate_up_proj``."""
    return {
        f"{prefix}gate_proj": (f"{prefix}gate_up_proj", 0, intermediate_size),
        f"{prefix}up_proj": (f"{prefix}gate_up_proj", intermediate_size, 2 * intermediate_size),
    }


def moe_fused_projections(config: MoEConfig, prefix: str = "mlp.") -> dict[str, tuple[str, int, int]]:
    """Checkpoint module -> fused rows for every expert (stored one by one: ``experts.{e}.gate_proj``)
    and the shared experts."""
    fused: dict[str, tuple[str, int, int]] = {}
    for expert in range(config.num_experts):
        fused.update(mlp_fused_projections(f"{prefix}experts.{expert}.", config.moe_intermediate_size))
    if config.num_shared_experts:
        shared = config.moe_intermediate_size * config.num_shared_experts
        fused.update(mlp_fused_projections(f"{prefix}shared_experts.", shared))
    if config.gated_shared_expert_size:
        fused.update(mlp_fused_projections(f"{prefix}shared_expert.", config.gated_shared_expert_size))
    return fused


def split_stacked_experts(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors with stacked experts split into per-expert ones.

    transformers >= 5 keeps a layer's experts as two 3-D tensors, ``experts.gate_up_proj``
    ``[E, 2 * inter, hidden]`` (gate rows first) and ``experts.down_proj`` ``[E, hidden, inter]``,
    and writes them that way with ``save_pretrained(save_original_format=False)``; Hub checkpoints
    (and the default ``save_pretrained``) store ``experts.{e}.{gate,up,down}_proj.weight``. This
    turns the first layout into the second, which :func:`moe_fused_projections` maps.
    """
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        if module.endswith("experts") and leaf in ("gate_up_proj", "down_proj") and tensor.dim() == 3:
            for expert, rows in enumerate(tensor.unbind(0)):
                if leaf == "down_proj":
                    yield f"{module}.{expert}.down_proj.weight", rows
                else:
                    gate, up = rows.chunk(2)
                    yield f"{module}.{expert}.gate_proj.weight", gate
                    yield f"{module}.{expert}.up_proj.weight", up
        else:
            yield name, tensor


class TopkRouter(nn.Module):
    """The router (see the module docstring). Its weight and DeepSeek's correction bias stay float32
    when the model is cast to a lower precision: expert choice is discrete, and a bias rounded to
    bf16 picks different experts than the model was trained with."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size, dtype=torch.float32))
        if config.scoring_func == "sigmoid":
            self.e_score_correction_bias = nn.Parameter(torch.zeros(config.num_experts, dtype=torch.float32))

    def _apply(self, fn: Callable[[torch.Tensor], torch.Tensor], recurse: bool = True) -> TopkRouter:
        # Follow device moves, ignore dtype casts.
        def keep_dtype(tensor: torch.Tensor) -> torch.Tensor:
            moved = fn(tensor)
            return moved if moved.dtype == tensor.dtype else tensor.to(moved.device)

        return super()._apply(keep_dtype, recurse)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``x`` ``[T, hidden]`` -> ``(weights, expert ids)``, each ``[T, num_experts_per_tok]``
        (weights float32)."""
        config = self.config
        logits = F.linear(x.float(), self.weight.float())
        if config.scoring_func == "softmax":
            weights, ids = logits.softmax(dim=-1).topk(config.num_experts_per_tok, dim=-1)
            if config.norm_topk_prob:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return weights, ids
        scores = logits.sigmoid()
        choice = scores + self.e_score_correction_bias
        if config.topk_group < config.n_group:
            grouped = choice.view(-1, config.n_group, config.num_experts // config.n_group)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)
            best_groups = group_scores.topk(config.topk_group, dim=-1, sorted=False).indices
            eligible = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best_groups, True)
            choice = grouped.masked_fill(~eligible[..., None], float("-inf")).view_as(scores)
        ids = choice.topk(config.num_experts_per_tok, dim=-1, sorted=False).indices
        weights = scores.gather(1, ids)
        if config.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return weights * config.routed_scaling_factor, ids


class MoE(nn.Module):
    """Routed experts plus shared experts; the names follow the checkpoint (``gate``, ``experts.{e}``,
    ``shared_experts`` or ``shared_expert`` and ``shared_expert_gate``) with gate/up fused per expert
    (:func:`moe_fused_projections`). Built in a tensor-parallel scope from a sharded config, it
    all-reduces its output once (see the module docstring)."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.parallel = current_tensor_parallel()
        self.gate = TopkRouter(config)
        self.experts = nn.ModuleList(
            gated_mlp(config.hidden_size, config.moe_intermediate_size, config.hidden_act, reduce=False)
            for _ in range(config.num_experts)
        )
        self.shared_experts = (
            gated_mlp(
                config.hidden_size,
                config.moe_intermediate_size * config.num_shared_experts,
                config.hidden_act,
                reduce=False,
            )
            if config.num_shared_experts
            else None
        )
        if config.gated_shared_expert_size:
            self.shared_expert = gated_mlp(
                config.hidden_size, config.gated_shared_expert_size, config.hidden_act, reduce=False
            )
            self.shared_expert_gate = Linear(config.hidden_size, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[T, hidden]`` -> ``[T, hidden]``."""
        weights, ids = self.gate(x)
        tokens, per_token = ids.shape
        pairs = ids.reshape(-1)  # pair p: token p // per_token and its expert
        # Pairs grouped by expert; one host read tells which experts received tokens and how many.
        order = pairs.argsort(stable=True)
        hit, counts = pairs[order].unique_consecutive(return_counts=True)
        # Row p: pair p's expert output. Written with index_copy_ and summed afterwards, because a
        # scatter-add (index_add_) into the output costs milliseconds per call on a busy CPU.
        outputs = x.new_empty(tokens * per_token, x.shape[1])
        start = 0
        for expert, count in zip(hit.tolist(), counts.tolist(), strict=True):
            chosen = order[start : start + count]
            start += count
            outputs.index_copy_(0, chosen, self.experts[expert](x.index_select(0, chosen // per_token)))
        weighted = outputs.view(tokens, per_token, -1).float() * weights.unsqueeze(-1)
        routed = weighted.sum(dim=1).to(x.dtype)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(x)
        if self.config.gated_shared_expert_size:
            routed = routed + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.parallel.all_reduce(routed)
