"""Training a DFlash block drafter (core's :class:`~sonar_core.spec_decode.block_proposer.BlockDraftHead`),
written in z-lab's layout.

For every training sequence the fused target states of all its positions are written as context
once; then blocks are drawn at random anchor positions ``p``, exactly as
:class:`~sonar_core.spec_decode.block_proposer.BlockProposer` drafts after the target read
position ``p - 1``: ``[token p, MASK x (B-1)]`` at positions ``p .. p+B-1``, attending
non-causally to the context before ``p`` and to the whole block. Slot ``s`` predicts the target's
distribution at ``p + s - 1`` (the token at ``p + s``).

The drafter's layers are Qwen3 layers (z-lab's, with per-head q/k norms) shaped like the target's;
it reads the same target states as EAGLE-3 and uses the target's embedding and LM head, as
z-lab's checkpoints do.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from sonar_core.spec_decode.block_layout import BlockTarget, read_block_layout
from sonar_core.spec_decode.block_proposer import BlockDraftHead
from sonar_core.spec_decode.draft_layouts import dflash_zlab_config, draft_layer_config, save_draft_checkpoint
from sonar_core.spec_decode.proposer import TargetHiddenStates
from sonar_core.training import paged
from sonar_core.training.dataset import TrainingSequence
from sonar_core.training.methods.base import (
    BatchLoss,
    FlatBatch,
    HeadOptions,
    HeadTrainer,
    PositionLoss,
    checkpoint_tensors,
)
from sonar_core.training.target import TrainingTarget

# Blocks trained per sequence and batch (drawn anew each time).
ANCHORS_PER_SEQUENCE = 32


class DFlashTrainer(HeadTrainer):
    method = "dflash"

    @classmethod
    def create(
        cls,
        target: TrainingTarget,
        options: HeadOptions,
        draft_vocab: torch.Tensor,
        layers: tuple[int, ...],
        mask_token_id: int,
    ) -> DFlashTrainer:
        return cls(target, options, draft_vocab, layers, mask_token_id)

    def __init__(
        self,
        target: TrainingTarget,
        options: HeadOptions,
        draft_vocab: torch.Tensor,
        layers: tuple[int, ...],
        mask_token_id: int,
    ) -> None:
        super().__init__(target, options, draft_vocab)
        hidden = target.hidden_size
        heads = target.config["num_attention_heads"]
        overrides = {
            "model_type": "qwen3",
            "head_dim": target.config.get("head_dim") or hidden // heads,
            "attention_bias": False,
        }
        if options.intermediate_size:
            overrides["intermediate_size"] = options.intermediate_size
        layer_config = draft_layer_config(
            target.config, options.num_layers, layer_types=["full_attention"] * options.num_layers, **overrides
        )
        self.block_size = options.depth + 1
        self.config = dflash_zlab_config(
            layer_config, num_target_layers=target.num_layers, block_size=self.block_size,
            target_layer_ids=[k - 1 for k in layers], mask_token_id=mask_token_id,
        )
        self.layout = read_block_layout(
            self.config, set(), BlockTarget(hidden, target.num_layers, target.vocab_size), "the trained drafter"
        )
        self.layers = self.layout.target_hidden_layers
        self.head = BlockDraftHead(self.layout, target.modules)

    @property
    def module(self) -> nn.Module:
        return self.head

    def batch_loss(self, sequences: list[TrainingSequence], generator: torch.Generator) -> BatchLoss:
        batch = FlatBatch(sequences)
        anchors = self._anchors(sequences, batch, generator)
        losses = PositionLoss(self.options.depth)
        if anchors.numel() == 0:
            return losses.result(self.head)
        slots = self.block_states(batch, anchors)
        final = batch.cat("final")
        for slot in range(1, self.block_size):
            # Targets only where a slot needs one: the full-vocabulary LM head is costly.
            targets = self.row_targets(final[anchors + slot - 1])
            losses.add(slot - 1, self.head.compute_logits(slots[:, slot]), targets, anchors)
        return losses.result(self.head)

    def block_states(self, batch: FlatBatch, anchors: torch.Tensor) -> torch.Tensor:
        """``[A, B, H]`` the head's slot states of the blocks anchored at rows ``anchors``: the
        context of every row written once, then each block over the context before its anchor."""
        block = self.block_size
        cache = paged.new_cache(self.head.kv_layers, batch.num_rows + anchors.numel() * block)
        context = paged.prefill(batch.lengths.tolist(), batch.bases.tolist())
        states = TargetHiddenStates(self.layers, self.target.hidden_size, aux=batch.cat("aux"))
        self.head.write_context(states, torch.arange(batch.num_rows), context, cache)
        private = batch.num_rows + torch.arange(anchors.numel() * block).view(-1, block)
        metadata = paged.rows_over_context(
            batch.bases[batch.seq_of[anchors]], batch.position[anchors], private, query_len=block, causal=self.layout.causal
        )
        tokens = torch.full((anchors.numel(), block), self.layout.mask_token_id, dtype=torch.int64)
        tokens[:, 0] = batch.token_after(anchors, 0)
        return self.head.block(tokens.view(-1), cache, metadata).view(anchors.numel(), block, -1)

    def _anchors(self, sequences: list[TrainingSequence], batch: FlatBatch, generator: torch.Generator) -> torch.Tensor:
        """Up to :data:`ANCHORS_PER_SEQUENCE` rows per sequence whose block has context before it
        and a label for every slot."""
        chosen = []
        for i, sequence in enumerate(sequences):
            last = sequence.num_rows + 1 - self.block_size
            if last < 1:
                continue
            candidates = torch.arange(1, last + 1)
            pick = torch.randperm(candidates.numel(), generator=generator)[:ANCHORS_PER_SEQUENCE]
            chosen.append(batch.bases[i] + candidates[pick.sort().values])
        return torch.cat(chosen) if chosen else torch.zeros(0, dtype=torch.int64)

    def export(self, out_dir: Path, dtype: torch.dtype) -> Path:
        tensors = {name: t.to(dtype) for name, t in checkpoint_tensors(self.head, self.layout.layer).items()}
        return save_draft_checkpoint(out_dir, tensors, self.config)
