"""The target as the trainer needs it: its embedding and LM head (shared with the heads, frozen),
its config, and its next-token choices, the labels every head learns.

A label is the target's own greedy choice at a position (the argmax of its LM head over the
exported final state, among the tokens the head scores): what greedy verification accepts. On the
answers it is the token that followed; on the prompt it is what the target would have said there.
Measured on SmolLM2 data, these hard labels trained a little better than the target's full
distribution, and they cost one integer per position instead of a vocabulary-wide row.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from sonar_core.model_files import DEFAULT_MODEL_NAME
from sonar_core.models.base import TargetModules


@dataclass
class TrainingTarget:
    """The target's shared modules (float32, CPU, no gradients) and description."""

    modules: TargetModules
    config: dict[str, Any]  # the target's config.json
    name: str  # as a head's config names its verifier

    @classmethod
    def load(cls, model: str | None) -> TrainingTarget:
        """Load ``model`` (resolved as the engine resolves it); only the embedding, final norm and
        LM head stay in memory."""
        from sonar_core.models.loader import load_model

        loaded = load_model(model, torch.float32, torch.device("cpu"))
        config = json.loads((Path(loaded.model_dir) / "config.json").read_text())
        return cls(loaded.model.shared_modules(), config, model or DEFAULT_MODEL_NAME)

    @property
    def hidden_size(self) -> int:
        return self.modules.hidden_size

    @property
    def vocab_size(self) -> int:
        return self.modules.vocab_size

    @property
    def num_layers(self) -> int:
        return self.modules.num_layers

    def lm_head_rows(self, token_ids: torch.Tensor | None) -> torch.Tensor:
        """``[len(token_ids), H]`` rows of the LM head (all rows for None), detached."""
        weight = self.modules.lm_head.weight.detach()
        return weight if token_ids is None else weight.index_select(0, token_ids)


def draft_vocabulary(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` most frequent token ids of ``counts`` (ties: the lower id), ascending: EAGLE-3's
    rule for a reduced draft vocabulary."""
    if not 0 < size <= counts.shape[0]:
        raise ValueError(f"a draft vocabulary of {size} tokens does not fit a vocabulary of {counts.shape[0]}")
    order = torch.argsort(-counts, stable=True)
    return order[:size].sort().values
