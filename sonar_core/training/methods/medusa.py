"""Training Medusa heads (sonar-medusa's :class:`~sonar_medusa.heads.MedusaHeads`), written in
vLLM's MedusaConfig layout.

Head ``h`` reads the target's final state at position ``t`` and predicts the target's
distribution at ``t + h + 1`` (the token ``h + 2`` after ``t``). Each head's residual block starts
at zero, so it starts as the target's own next-token head; all heads share one LM head
(``original_lm_head``), the target's rows of the draft vocabulary, frozen, with a ``token_map`` to
target ids when the vocabulary is reduced.
"""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from sonar_core.spec_decode.draft_layouts import medusa_config, save_draft_checkpoint
from sonar_core.training.dataset import TrainingSequence
from sonar_core.training.methods.base import BatchLoss, FlatBatch, HeadOptions, HeadTrainer, PositionLoss
from sonar_core.training.target import TrainingTarget


class MedusaTrainer(HeadTrainer):
    method = "medusa"
    reduces_vocabulary = True

    def __init__(self, target: TrainingTarget, options: HeadOptions, draft_vocab: torch.Tensor) -> None:
        from sonar_medusa.heads import MedusaHeads
        from sonar_medusa.layout import VLLM, MedusaLayout

        super().__init__(target, options, draft_vocab)
        self.layout = MedusaLayout(
            layout=VLLM, num_heads=options.depth, num_layers=options.num_layers, hidden_size=target.hidden_size,
            vocab_size=target.vocab_size, draft_vocab_size=int(draft_vocab.shape[0]), block_bias=True,
            shared_lm_head=True, has_token_map=not self.full_vocabulary,
        )
        self.heads = MedusaHeads(self.layout, options.depth)
        with torch.no_grad():
            self.heads.block_weight.zero_()
            self.heads.block_bias.zero_()
            self.heads.lm_head_weight.copy_(self.lm_head_rows.unsqueeze(0))
        self.heads.block_weight.requires_grad_(True)
        self.heads.block_bias.requires_grad_(True)

    @property
    def module(self) -> nn.Module:
        return self.heads

    def batch_loss(self, sequences: list[TrainingSequence], generator: torch.Generator) -> BatchLoss:
        losses = PositionLoss(self.options.depth)
        batch = FlatBatch(sequences)
        final = batch.cat("final")
        logits = self.heads(final)  # [heads, rows, V']
        targets = self.row_targets(final)
        all_rows = torch.arange(batch.num_rows)
        for head in range(self.options.depth):
            rows = all_rows[batch.within(all_rows, head + 1)]
            losses.add(head, logits[head, rows], targets[rows + head + 1], rows)
        return losses.result(self.heads)

    def export(self, out_dir: Path, dtype: torch.dtype) -> Path:
        tensors: dict[str, torch.Tensor] = {}
        for head in range(self.layout.num_heads):
            for layer in range(self.layout.num_layers):
                tensors[self.layout.block_name(head, layer, "weight")] = self.heads.block_weight[head, layer].detach().to(dtype)
                tensors[self.layout.block_name(head, layer, "bias")] = self.heads.block_bias[head, layer].detach().to(dtype)
        tensors[self.layout.lm_head_name(0)] = self.heads.lm_head_weight[0].detach().to(dtype)
        if self.layout.has_token_map:
            tensors["token_map"] = self.draft_vocab.clone()
        config = medusa_config(
            hidden_size=self.layout.hidden_size, vocab_size=self.layout.vocab_size, num_heads=self.layout.num_heads,
            num_layers=self.layout.num_layers, truncated_vocab_size=self.layout.draft_vocab_size, fc_bias=True,
            original_lm_head=True,
        )
        return save_draft_checkpoint(out_dir, tensors, config)
