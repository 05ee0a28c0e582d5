"""From an EAGLE checkpoint to a head on the device: checked whole before anything is allocated."""

from __future__ import annotations

import torch

from sonar_core.errors import ConfigError
from sonar_core.layers.decoder import fused_projections
from sonar_core.layers.linear import prepack_linears
from sonar_core.models.base import TargetModules
from sonar_core.models.weights import CheckpointError, expected_checkpoint_shapes, load_named_weights
from sonar_core.spec_decode.draft_checkpoint import FIELD, DraftCheckpoint
from sonar_core.spec_decode.vocab_map import DraftVocabularyMap
from sonar_eagle.heads import head_class
from sonar_eagle.layout import EagleLayout, TargetShape, read_layout


def expected_layout(layout: EagleLayout) -> dict[str, tuple[int, ...]]:
    """Every tensor name a checkpoint of ``layout`` holds, with its shape; the head is built on
    the meta device, so nothing is allocated. ``t2d`` is optional, ``d2t`` too without a reduced
    draft vocabulary."""
    with torch.device("meta"):
        head = head_class(layout)(layout)
    shapes = expected_checkpoint_shapes(head, fused_projections(layout.layer))
    shapes["d2t"] = (layout.draft_vocab_size,)
    shapes["t2d"] = (layout.target_vocab_size,)
    return shapes


def check_checkpoint(checkpoint: DraftCheckpoint, method: str, target: TargetShape) -> EagleLayout:
    """The checkpoint's layout, after checking every tensor's presence and shape (no weights read)."""
    layout = read_layout(checkpoint, method, target)
    _check_vocab_tensors(checkpoint, layout)
    checkpoint.check_layout(
        expected_layout(layout),
        rename=layout.rename,
        optional=frozenset({"t2d"} if layout.has_vocab_map else {"t2d", "d2t"}),
        ignored=lambda name: not (layout.loaded_by_head(name) or name in ("d2t", "t2d")),
    )
    return layout


def load_head(
    checkpoint: DraftCheckpoint, method: str, target: TargetModules, dtype: torch.dtype, device: torch.device
) -> tuple[torch.nn.Module, DraftVocabularyMap]:
    """The head with its weights, sharing the target's modules where the checkpoint has none, and
    the map from its vocabulary to the target's."""
    shape = TargetShape(target.hidden_size, target.num_layers, target.vocab_size)
    layout = check_checkpoint(checkpoint, method, shape)
    with torch.device("meta"):
        head = head_class(layout)(layout, target)
    head = head.to(dtype=dtype).to_empty(device=device)
    try:
        load_named_weights(
            head,
            checkpoint.tensors(rename=layout.rename, include=layout.loaded_by_head),
            fused_projections(layout.layer),
        )
    except CheckpointError as exc:
        raise ConfigError(FIELD, f"{checkpoint.describe()}: {exc}", "re-export the checkpoint") from None
    head = head.eval().requires_grad_(False)
    prepack_linears(head)
    return head, _vocab_map(checkpoint, layout).to(device)


def _vocab_map(checkpoint: DraftCheckpoint, layout: EagleLayout) -> DraftVocabularyMap:
    if not layout.has_vocab_map:
        return DraftVocabularyMap.identity(layout.target_vocab_size)
    maps = dict(checkpoint.tensors(include=lambda name: name in ("d2t", "t2d")))
    return DraftVocabularyMap.from_d2t(
        maps["d2t"], layout.target_vocab_size, layout.draft_vocab_size, maps.get("t2d"),
        field=FIELD, source=checkpoint.describe(),
    )


def _check_vocab_tensors(checkpoint: DraftCheckpoint, layout: EagleLayout) -> None:
    """The vocabulary maps must fit draft_vocab_size and the target vocabulary."""
    d2t, t2d = checkpoint.shapes.get("d2t"), checkpoint.shapes.get("t2d")
    fix = "use the d2t/t2d written with this head (draft_vocab_size must be the length of d2t)"
    if layout.has_vocab_map and d2t is None:
        raise ConfigError(
            FIELD,
            f"{checkpoint.describe()} has draft_vocab_size {layout.draft_vocab_size} below the target's "
            f"{layout.target_vocab_size} tokens but no d2t map",
            fix,
        )
    if d2t is not None and tuple(d2t) != (layout.draft_vocab_size,):
        raise ConfigError(
            FIELD, f"{checkpoint.describe()}: d2t has shape {list(d2t)}, but draft_vocab_size is {layout.draft_vocab_size}", fix
        )
    if t2d is not None and tuple(t2d) != (layout.target_vocab_size,):
        raise ConfigError(
            FIELD,
            f"{checkpoint.describe()}: t2d has shape {list(t2d)}, but the target vocabulary has "
            f"{layout.target_vocab_size} tokens",
            fix,
        )
