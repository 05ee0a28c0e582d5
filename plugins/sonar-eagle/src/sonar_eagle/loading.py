"""From an EAGLE checkpoint to a head on the device, through core's head loading."""

from __future__ import annotations

import torch

from sonar_core.layers.decoder import fused_projections
from sonar_core.models.base import TargetModules
from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint
from sonar_core.spec_decode.head_loading import HeadSpec, check_head_checkpoint, load_head_checkpoint
from sonar_core.spec_decode.vocab_map import DraftVocabularyMap
from sonar_eagle.heads import head_class
from sonar_eagle.layout import EagleLayout, TargetShape, read_layout


def head_spec(layout: EagleLayout) -> HeadSpec:
    return HeadSpec(
        build=lambda target: head_class(layout)(layout, target),
        fused=fused_projections(layout.layer),
        vocab_size=layout.target_vocab_size,
        draft_vocab_size=layout.draft_vocab_size,
        rename=layout.rename,
        skipped=layout.skipped,
    )


def check_checkpoint(checkpoint: DraftCheckpoint, method: str, target: TargetShape) -> EagleLayout:
    """The checkpoint's layout, after checking every tensor's presence and shape (no weights read)."""
    layout = read_layout(checkpoint, method, target)
    check_head_checkpoint(checkpoint, head_spec(layout))
    return layout


def load_head(
    checkpoint: DraftCheckpoint, method: str, target: TargetModules, dtype: torch.dtype, device: torch.device
) -> tuple[torch.nn.Module, DraftVocabularyMap]:
    """The head with its weights, sharing the target's modules where the checkpoint has none, and
    the map from its vocabulary to the target's."""
    layout = read_layout(checkpoint, method, TargetShape(target.hidden_size, target.num_layers, target.vocab_size))
    return load_head_checkpoint(checkpoint, head_spec(layout), target, dtype, device)
