"""Training IBM's MLP speculator (sonar-mlp-speculator's
:class:`~sonar_mlp_speculator.speculator.MLPSpeculator`), written in the fms-extras layout.

Stage ``i`` reads the running state (the target's final state at position ``t`` for the first)
and token ``t + i + 1``, and predicts the target's distribution at ``t + i + 1``. The layout scores
the whole vocabulary with an embedding and an LM head of ``vocab x inner_dim`` each, far more
weights than the data can train here, so the speculator is tied (one embedding, head and norm for
every stage, as fms-extras' ``tie_weights``) with ``inner_dim`` equal to the hidden size, and its
embedding and head start as the target's and stay frozen: the projections and the norm learn.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from sonar_core.spec_decode.draft_layouts import mlp_speculator_config, save_draft_checkpoint
from sonar_core.training.dataset import TrainingSequence
from sonar_core.training.methods.base import BatchLoss, FlatBatch, HeadOptions, HeadTrainer, PositionLoss
from sonar_core.training.target import TrainingTarget

PREFIX = "speculator."


class MLPSpeculatorTrainer(HeadTrainer):
    method = "mlp_speculator"

    def __init__(self, target: TrainingTarget, options: HeadOptions, draft_vocab: torch.Tensor) -> None:
        from sonar_mlp_speculator.speculator import MLPSpeculator, MLPSpeculatorLayout

        super().__init__(target, options, draft_vocab)
        hidden = target.hidden_size
        self.layout = MLPSpeculatorLayout(
            n_predict=options.depth, emb_dim=hidden, inner_dim=hidden, vocab_size=target.vocab_size,
            tie_weights=True, scale_input=True,
        )
        self.speculator = MLPSpeculator(self.layout)
        with torch.no_grad():
            self.speculator.emb[0].weight.copy_(target.modules.embed_tokens.weight)
            self.speculator.head[0].weight.copy_(self.lm_head_rows)
        self.speculator.emb[0].weight.requires_grad_(False)
        self.speculator.head[0].weight.requires_grad_(False)

    @property
    def module(self) -> nn.Module:
        return self.speculator

    def batch_loss(self, sequences: list[TrainingSequence], generator: torch.Generator) -> BatchLoss:
        losses = PositionLoss(self.options.depth)
        batch = FlatBatch(sequences)
        final = batch.cat("final")
        targets = self.row_targets(final)
        rows = torch.arange(batch.num_rows)
        rows = rows[batch.within(rows, 1)]
        state = self.speculator.first_state(final[rows])
        for stage in range(self.options.depth):
            keep = batch.within(rows, stage + 1)
            rows, state = rows[keep], state[keep]
            if rows.numel() == 0:
                break
            state, logits = self.speculator.stage(stage, state, batch.token_after(rows, stage + 1))
            losses.add(stage, logits, targets[rows + stage + 1], rows)
        return losses.result(self.speculator)

    def export(self, out_dir: Path, dtype: torch.dtype) -> Path:
        tensors = {PREFIX + name: p.detach().to(dtype).clone() for name, p in self.speculator.named_parameters()}
        config = mlp_speculator_config(
            vocab_size=self.layout.vocab_size, emb_dim=self.layout.emb_dim, inner_dim=self.layout.inner_dim,
            n_predict=self.layout.n_predict, tie_weights=True, scale_input=True,
        )
        return save_draft_checkpoint(out_dir, tensors, config)
