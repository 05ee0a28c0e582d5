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


def parallel_drafting_refused(config: SpeculativeConfig) -> ConfigError | None:
    """The error for an explicit ``parallel_drafting`` given to a block drafter, which always drafts
    its whole block in one pass (None when unset)."""
    if config.parallel_drafting is None:
        return None
    return ConfigError(
        "parallel_drafting",
        f"method {config.method!r} selects parallel drafting automatically (it drafts a whole block in one pass)",
        "do not set parallel_drafting for this method: remove it",
    )


def non_causal_backend_refused(config: SpeculativeConfig) -> ConfigError | None:
    """The error for a draft attention backend without non-causal attention, given to a method whose
    draft attends non-causally within its block (None when the backend supports it)."""
    from sonar_core.attention_backends import BACKENDS, get_backend

    backend = get_backend(config.attention_backend)
    if backend is None or backend.non_causal:
        return None
    compatible = ", ".join(name for name, other in BACKENDS.items() if other.non_causal)
    return ConfigError(
        "attention_backend",
        f"non-causal attention is unsupported by the draft attention backend {backend.name}, and method "
        f"{config.method!r} attends non-causally within its draft block",
        f"set a compatible draft attention backend: {compatible}",
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
