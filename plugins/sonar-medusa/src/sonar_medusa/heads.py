"""Medusa heads computed together: every head's ResBlocks and LM head as one batched matmul each.

Head ``h`` maps the target's final state ``x`` through ``x = x + SiLU(W_{h,l} x + b_{h,l})`` for
each of its layers, then scores with its own LM head; it predicts the token ``h + 1`` positions
after the newest one. The weights of all heads are stacked (``[heads, ...]``), so a step costs one
batched matmul per layer and one for the LM heads, whatever the number of heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from sonar_core.errors import ConfigError
from sonar_core.models.meta_build import materialize, on_meta_device
from sonar_core.sample.processing import SamplingBatch
from sonar_core.spec_decode.draft_checkpoint import FIELD, DraftCheckpoint
from sonar_core.spec_decode.draft_sampling import DraftSample, DraftSampler
from sonar_core.spec_decode.state_head_proposer import StateHeadProposer
from sonar_medusa.layout import MedusaLayout


class MedusaHeads(nn.Module):
    """The first ``num_heads`` heads of a layout, stacked."""

    def __init__(self, layout: MedusaLayout, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        hidden, layers = layout.hidden_size, layout.num_layers
        self.block_weight = nn.Parameter(torch.empty(num_heads, layers, hidden, hidden), requires_grad=False)
        self.block_bias = (
            nn.Parameter(torch.empty(num_heads, layers, hidden), requires_grad=False) if layout.block_bias else None
        )
        lm_heads = 1 if layout.shared_lm_head else num_heads
        self.lm_head_weight = nn.Parameter(torch.empty(lm_heads, layout.draft_vocab_size, hidden), requires_grad=False)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        """``[R, H]`` final states -> ``[heads, R, Vd]`` float32 logits."""
        x = states.unsqueeze(0).expand(self.num_heads, -1, -1)
        for layer in range(self.block_weight.shape[1]):
            y = torch.bmm(x, self.block_weight[:, layer].transpose(1, 2))
            if self.block_bias is not None:
                y = y + self.block_bias[:, layer].unsqueeze(1)
            x = x + F.silu(y)
        lm = self.lm_head_weight.expand(self.num_heads, -1, -1) if self.lm_head_weight.shape[0] == 1 else self.lm_head_weight
        return torch.bmm(x, lm.transpose(1, 2)).float()


def load_heads(
    checkpoint: DraftCheckpoint, layout: MedusaLayout, num_heads: int, dtype: torch.dtype, device: torch.device
) -> tuple[MedusaHeads, torch.Tensor | None]:
    """The first ``num_heads`` heads with their weights, and the token map (None: full vocabulary)."""
    with on_meta_device():
        heads = MedusaHeads(layout, num_heads)
    heads = materialize(heads, dtype, device)
    tensors = dict(checkpoint.tensors(rename=MedusaLayout.rename))
    with torch.no_grad():
        for head in range(num_heads):
            for layer in range(layout.num_layers):
                heads.block_weight[head, layer].copy_(tensors[layout.block_name(head, layer, "weight")])
                if heads.block_bias is not None:
                    heads.block_bias[head, layer].copy_(tensors[layout.block_name(head, layer, "bias")])
        for row in range(heads.lm_head_weight.shape[0]):
            heads.lm_head_weight[row].copy_(tensors[layout.lm_head_name(row)])
    token_map = tensors.get("token_map")
    if token_map is not None:
        token_map = token_map.to(torch.int64)
        if len(set(token_map.tolist())) != len(token_map) or int(token_map.min()) < 0 or int(token_map.max()) >= layout.vocab_size:
            raise ConfigError(
                FIELD,
                f"{checkpoint.describe()}: token_map must hold distinct target ids below {layout.vocab_size}",
                "use the token_map written with these heads",
            )
        token_map = token_map.to(device)
    return heads.eval(), token_map


class MedusaProposer(StateHeadProposer):
    """Drafts position ``h`` from head ``h``: every position is sampled independently."""

    def __init__(self, heads: MedusaHeads, sampler: DraftSampler) -> None:
        super().__init__(sampler, max_depth=heads.num_heads)
        self.heads = heads

    def draft(
        self, states: torch.Tensor, newest_tokens: torch.Tensor, depth: int, sampling: SamplingBatch | None
    ) -> list[DraftSample]:
        logits = self.heads(states)
        return [self.sampler.sample(logits[head], sampling) for head in range(depth)]
