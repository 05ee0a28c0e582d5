"""Checking and loading a draft head from its checkpoint, for every method whose head is a module
built from a layout (EAGLE, DFlash, DSpark).

:func:`check_head_checkpoint` builds the head on the meta device (nothing is allocated), derives
every tensor name and shape it needs, and compares them with the checkpoint's headers, together
with the reduced-vocabulary maps (``d2t``, and the optional ``t2d``). :func:`load_head_checkpoint`
then builds it for real, sharing the target's modules where the checkpoint has none, and loads it
strictly: a checkpoint that passed the check loads whole, one that did not never starts loading.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from sonar_core.errors import ConfigError
from sonar_core.layers.linear import prepack_linears
from sonar_core.models.base import TargetModules
from sonar_core.models.meta_build import materialize, on_meta_device
from sonar_core.models.weights import (
    CheckpointError,
    FusedMap,
    expected_checkpoint_shapes,
    load_named_weights,
)
from sonar_core.spec_decode.draft_checkpoint import FIELD, DraftCheckpoint
from sonar_core.spec_decode.vocab_map import DraftVocabularyMap

VOCAB_MAPS = ("d2t", "t2d")


@dataclass(frozen=True)
class HeadSpec:
    """How a checkpoint becomes a head module."""

    # Builds the head; given None on the meta device (for the check), the target's modules to load.
    build: Callable[[TargetModules | None], nn.Module]
    fused: FusedMap
    vocab_size: int  # the target's
    draft_vocab_size: int  # the head's output vocabulary (d2t maps it when smaller)
    # Checkpoint name -> the head's parameter name.
    rename: Callable[[str], str] = field(default=lambda name: name)
    # Tensors the checkpoint may carry that the head does not load (training-only ones).
    skipped: Callable[[str], bool] = field(default=lambda name: False)

    @property
    def has_vocab_map(self) -> bool:
        return self.draft_vocab_size != self.vocab_size

    def loads(self, name: str) -> bool:
        return name not in VOCAB_MAPS and not self.skipped(name)


def check_head_checkpoint(checkpoint: DraftCheckpoint, spec: HeadSpec) -> None:
    """Every tensor the head needs present and of its shape, nothing unknown, vocabulary maps that
    fit; one ConfigError listing every problem (no weights are read)."""
    _check_vocab_tensors(checkpoint, spec)
    with on_meta_device():
        head = spec.build(None)
    expected = expected_checkpoint_shapes(head, spec.fused)
    expected["d2t"] = (spec.draft_vocab_size,)
    expected["t2d"] = (spec.vocab_size,)
    checkpoint.check_layout(
        expected,
        rename=spec.rename,
        optional=frozenset({"t2d"} if spec.has_vocab_map else VOCAB_MAPS),
        ignored=spec.skipped,
    )


def load_head_checkpoint(
    checkpoint: DraftCheckpoint, spec: HeadSpec, target: TargetModules, dtype: torch.dtype, device: torch.device
) -> tuple[nn.Module, DraftVocabularyMap]:
    """The head with its weights on ``device`` (linear weights prepacked where the CPU allows),
    and the map from its vocabulary to the target's."""
    check_head_checkpoint(checkpoint, spec)
    with on_meta_device():
        head = spec.build(target)
    head = materialize(head, dtype, device)
    try:
        load_named_weights(head, checkpoint.tensors(rename=spec.rename, include=spec.loads), spec.fused)
    except CheckpointError as exc:
        raise ConfigError(FIELD, f"{checkpoint.describe()}: {exc}", "re-export the checkpoint") from None
    head = head.eval().requires_grad_(False)
    prepack_linears(head)
    return head, _vocab_map(checkpoint, spec).to(device)


def _vocab_map(checkpoint: DraftCheckpoint, spec: HeadSpec) -> DraftVocabularyMap:
    if not spec.has_vocab_map:
        return DraftVocabularyMap.identity(spec.vocab_size)
    maps = dict(checkpoint.tensors(include=lambda name: name in VOCAB_MAPS))
    return DraftVocabularyMap.from_d2t(
        maps["d2t"], spec.vocab_size, spec.draft_vocab_size, maps.get("t2d"), field=FIELD, source=checkpoint.describe()
    )


def _check_vocab_tensors(checkpoint: DraftCheckpoint, spec: HeadSpec) -> None:
    """The vocabulary maps must fit draft_vocab_size and the target vocabulary."""
    d2t, t2d = checkpoint.shapes.get("d2t"), checkpoint.shapes.get("t2d")
    fix = "use the d2t/t2d written with this head (draft_vocab_size must be the length of d2t)"
    if spec.has_vocab_map and d2t is None:
        raise ConfigError(
            FIELD,
            f"{checkpoint.describe()} has draft_vocab_size {spec.draft_vocab_size} below the target's "
            f"{spec.vocab_size} tokens but no d2t map",
            fix,
        )
    if d2t is not None and tuple(d2t) != (spec.draft_vocab_size,):
        raise ConfigError(
            FIELD, f"{checkpoint.describe()}: d2t has shape {list(d2t)}, but draft_vocab_size is {spec.draft_vocab_size}", fix
        )
    if t2d is not None and tuple(t2d) != (spec.vocab_size,):
        raise ConfigError(
            FIELD,
            f"{checkpoint.describe()}: t2d has shape {list(t2d)}, but the target vocabulary has {spec.vocab_size} tokens",
            fix,
        )
