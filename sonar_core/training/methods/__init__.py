"""The trainable heads, one module per method; :func:`build_trainer` makes the one asked for.

Each wraps the module its plugin drafts with (imported from that plugin), so a method is trainable
here only when its plugin is installed. This module imports neither torch nor a trainer, so the
command line can list the methods without loading either.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from sonar_core.errors import ConfigError
from sonar_core.plugins import SONAR_METHOD_PACKAGES, install_command

if TYPE_CHECKING:
    import torch

    from sonar_core.training.methods.base import HeadOptions, HeadTrainer
    from sonar_core.training.target import TrainingTarget

# method -> the trainer class, in the module of the same name under sonar_core.training.methods.
_TRAINERS: dict[str, str] = {
    "eagle3": "Eagle3Trainer",
    "medusa": "MedusaTrainer",
    "mlp_speculator": "MLPSpeculatorTrainer",
    "dflash": "DFlashTrainer",
}
METHODS: tuple[str, ...] = tuple(_TRAINERS)
# What a head can learn at each position (HeadOptions.labels): the target's greedy choice, or its
# whole distribution over the head's vocabulary.
LABEL_KINDS: tuple[str, ...] = ("choice", "distribution")


def trainer_class(method: str) -> type[HeadTrainer]:
    """The trainer of ``method``; a ConfigError for a method that cannot be trained or whose plugin
    is missing (its distribution from SONAR_METHOD_PACKAGES, its module that name with ``_``)."""
    if method not in _TRAINERS:
        raise ConfigError("method", f"{method!r} cannot be trained here", f"choose one of {', '.join(METHODS)}")
    package = SONAR_METHOD_PACKAGES[method]
    try:
        importlib.import_module(package.replace("-", "_"))
    except ImportError:
        raise ConfigError(
            "method", f"training {method} needs its plugin, which is not installed", install_command(package)
        ) from None
    return getattr(importlib.import_module(f"{__name__}.{method}"), _TRAINERS[method])


def reduces_vocabulary(method: str) -> bool:
    """Whether ``method``'s head can score a reduced draft vocabulary."""
    return trainer_class(method).reduces_vocabulary


def build_trainer(
    method: str,
    target: TrainingTarget,
    options: HeadOptions,
    draft_vocab: torch.Tensor,
    layers: tuple[int, ...],
    mask_token_id: int,
) -> HeadTrainer:
    """The trainer of ``method`` for ``target`` (a ConfigError when its plugin is missing)."""
    return trainer_class(method).create(target, options, draft_vocab, layers, mask_token_id)
