"""Configuration rules that many methods share, for their ``sonar_validate_speculative_config``.

Methods that draft without a checkpoint (prompt lookup, suffix trees, a user's bigram table) and
without a distribution over the vocabulary all refuse ``model`` and ignore probabilistic drafting;
methods that draft with a trained checkpoint (a draft model, EAGLE, Medusa heads) all need one.
These helpers give every such plugin the same error and warning, worded once.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sonar_core.errors import ConfigError

if TYPE_CHECKING:
    from sonar_core.config import SpeculativeConfig


def checkpoint_refused(config: SpeculativeConfig, drafts_from: str) -> ConfigError | None:
    """The error for a ``model`` given to a method that loads no checkpoint (None when unset).

    ``drafts_from`` completes "method X drafts from ...", so the user learns why no model is needed.
    Returned rather than raised, so a plugin can report it with its other problems.
    """
    if config.model is None:
        return None
    return ConfigError(
        "model",
        f"method {config.method!r} drafts from {drafts_from} and loads no checkpoint, "
        f"but model={config.model!r} is set",
        "remove 'model' from the speculative config",
    )


def checkpoint_required(config: SpeculativeConfig, drafts_with: str) -> ConfigError | None:
    """The error for a method that drafts with a checkpoint when ``model`` is unset (None when set).

    ``drafts_with`` completes "method X drafts with ..." (``"a trained EAGLE head"``).
    """
    if config.model is not None:
        return None
    return ConfigError(
        "model",
        f"method {config.method!r} drafts with {drafts_with}, and none was given",
        f'set "model" to the folder of {drafts_with} for this target',
    )


def one_hot_drafts_warning(config: SpeculativeConfig) -> str | None:
    """The warning for ``draft_sample_method: probabilistic`` on a method whose drafts carry no
    probabilities (None when drafting is greedy)."""
    if config.draft_sample_method != "probabilistic":
        return None
    return (
        f"speculative_config.draft_sample_method: 'probabilistic' has no effect with method "
        f"{config.method!r}: its drafts have no probabilities and are verified as one-hot drafts; "
        "remove draft_sample_method"
    )
