"""The trainable heads, one module per method; :func:`build_trainer` makes the one asked for.

Each wraps the module its plugin drafts with (imported from that plugin), so a method is trainable
here only when its plugin is installed.
"""

from __future__ import annotations

import importlib

import torch

from sonar_core.errors import ConfigError
from sonar_core.plugins import install_command
from sonar_core.training.methods.base import HeadOptions, HeadTrainer
from sonar_core.training.target import TrainingTarget

# method -> (the distribution whose module the head is, whether it can score a reduced vocabulary)
METHODS: dict[str, tuple[str, bool]] = {
    "eagle3": ("sonar-eagle", True),
    "medusa": ("sonar-medusa", True),
    "mlp_speculator": ("sonar-mlp-speculator", False),
    "dflash": ("sonar-dflash", False),
}
_PLUGIN_MODULES = {"eagle3": "sonar_eagle", "medusa": "sonar_medusa", "mlp_speculator": "sonar_mlp_speculator",
                   "dflash": "sonar_dflash"}


def reduces_vocabulary(method: str) -> bool:
    return METHODS[method][1]


def build_trainer(
    method: str,
    target: TrainingTarget,
    options: HeadOptions,
    draft_vocab: torch.Tensor,
    layers: tuple[int, ...],
    mask_token_id: int,
) -> HeadTrainer:
    """The trainer of ``method`` (a ConfigError when its plugin is missing)."""
    if method not in METHODS:
        raise ConfigError("method", f"{method!r} cannot be trained here", f"choose one of {', '.join(METHODS)}")
    try:
        importlib.import_module(_PLUGIN_MODULES[method])
    except ImportError:
        raise ConfigError(
            "method", f"training {method} needs its plugin, which is not installed", install_command(METHODS[method][0])
        ) from None
    if method == "eagle3":
        from sonar_core.training.methods.eagle3 import Eagle3Trainer

        return Eagle3Trainer(target, options, draft_vocab, layers)
    if method == "medusa":
        from sonar_core.training.methods.medusa import MedusaTrainer

        return MedusaTrainer(target, options, draft_vocab)
    if method == "mlp_speculator":
        from sonar_core.training.methods.mlp_speculator import MLPSpeculatorTrainer

        return MLPSpeculatorTrainer(target, options, draft_vocab)
    from sonar_core.training.methods.dflash import DFlashTrainer

    return DFlashTrainer(target, options, draft_vocab, layers, mask_token_id)
