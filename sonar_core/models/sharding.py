"""How a checkpoint's tensors split over tensor-parallel ranks.

Column-parallel projections (q/k/v, gate/up) keep a contiguous block of output rows per rank, a
whole number of heads; row-parallel ones (the attention output and MLP down projections) keep the
matching block of input columns, and their partial outputs are summed by one all-reduce
(:class:`~sonar_core.layers.linear.RowParallelLinear`). Everything else (embedding, norms, LM
head, row-parallel biases) is replicated: every rank holds the full residual stream, so a
proposer on the driver reads whole hidden states and shares a whole embedding and LM head.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

from sonar_core.layers.decoder import DecoderLayerConfig
from sonar_core.layers.tensor_parallel import TensorParallel


@dataclass(frozen=True)
class ShardRule:
    """Tensors whose name ends with ``suffix`` split along ``dim``. ``segments``: the dim holds
    several stacked blocks of these sizes (a convolution over q, k and v side by side), each split
    on its own so that every rank keeps its share of each."""

    suffix: str
    dim: int
    segments: tuple[int, ...] | None = None

    def apply(self, tensor: torch.Tensor, parallel: TensorParallel) -> torch.Tensor:
        if self.segments is None:
            return parallel.shard(tensor, self.dim).contiguous()
        if sum(self.segments) != tensor.shape[self.dim]:
            raise ValueError(
                f"*{self.suffix}: dim {self.dim} has {tensor.shape[self.dim]} entries, not the "
                f"{sum(self.segments)} of its blocks {self.segments}"
            )
        blocks = tensor.split(list(self.segments), dim=self.dim)
        return torch.cat([parallel.shard(block, self.dim) for block in blocks], dim=self.dim)


def projection_rules(
    column: Iterable[str], row: Iterable[str], biased_columns: bool = True
) -> tuple[ShardRule, ...]:
    """Rules for column-parallel modules (output rows split, with their biases) and row-parallel
    modules (input columns split; their biases stay whole)."""
    rules = [ShardRule(f"{name}.weight", 0) for name in column]
    if biased_columns:
        rules += [ShardRule(f"{name}.bias", 0) for name in column]
    return (*rules, *(ShardRule(f"{name}.weight", 1) for name in row))


# The decoder layer of :mod:`sonar_core.layers.decoder`, as checkpoints name its projections.
DECODER_LAYER_RULES = projection_rules(
    column=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
    row=("self_attn.o_proj", "mlp.down_proj"),
)


def shard_weights(
    weights: Iterable[tuple[str, torch.Tensor]], rules: Iterable[ShardRule], parallel: TensorParallel
) -> Iterator[tuple[str, torch.Tensor]]:
    """This rank's share of each checkpoint tensor (the first rule whose suffix the name ends with;
    tensors no rule names pass whole)."""
    rules = tuple(rules)
    for name, tensor in weights:
        rule = next((r for r in rules if name.endswith(r.suffix)), None)
        yield name, (tensor if rule is None or parallel.size == 1 else rule.apply(tensor, parallel))


def shard_layer_config(config: DecoderLayerConfig, parallel: TensorParallel) -> DecoderLayerConfig:
    """The layer shape one rank builds: its share of the heads, KV heads and MLP columns."""
    return parallel.split_fields(config, "num_heads", "num_kv_heads", "intermediate_size")
