"""Which target hidden states a draft reads: Sonar's index and the published conventions.

Sonar's index (what ``ProposerCapabilities.target_hidden_layers`` holds): state ``k`` is the
residual stream after ``k`` decoder layers, ``0`` the embeddings, ``L`` the last layer's output
before the final norm. Draft checkpoints name their layers in one of three conventions:

===================================  ==========================================================
convention                           id ``k`` means
===================================  ==========================================================
vLLM capture id (speculators         the stream entering layer ``k``: Sonar's index, unchanged
``eagle_aux_hidden_state_layer_ids``,
``aux_hidden_state_layer_ids``)
Hugging Face ``hidden_states`` index the same, except that ``k == L`` is the *normed* final
(SafeAILab EAGLE-3 capture code)     state, which Sonar hands over as the final hidden state
DFlash / DSpark ``target_layer_ids`` the output of layer ``k``: Sonar's ``k + 1`` (``-1``: the
                                     embeddings)
===================================  ==========================================================

Drafts must read raw residual values: the final norm is never applied to a captured state.
"""

from __future__ import annotations

from collections.abc import Iterable

from sonar_core.errors import ConfigError


def from_capture_ids(ids: Iterable[int]) -> tuple[int, ...]:
    """vLLM / speculators capture ids are Sonar's index already."""
    return tuple(int(k) for k in ids)


def from_dflash_target_layer_ids(ids: Iterable[int]) -> tuple[int, ...]:
    """DFlash / DSpark ``target_layer_ids`` (layer outputs, ``-1`` the embeddings) -> Sonar's index."""
    return tuple(int(k) + 1 for k in ids)


def from_hf_hidden_states_indices(ids: Iterable[int], num_layers: int) -> tuple[tuple[int, ...], bool]:
    """Hugging Face ``hidden_states`` indices -> (Sonar's indices, whether the final normed state
    is asked for). Index ``num_layers`` is transformers' normed last entry, not a raw state."""
    raw = tuple(int(k) for k in ids if int(k) != num_layers)
    return raw, any(int(k) == num_layers for k in ids)


def eagle3_default_layers(num_layers: int) -> tuple[int, ...]:
    """The states EAGLE-3 reads when its checkpoint names none: those entering layers 2, L/2 and
    L-3 (SafeAILab's capture code and vLLM's default)."""
    return (2, num_layers // 2, num_layers - 3)


def check_layers(layers: Iterable[int], num_layers: int, field: str, source: str) -> tuple[int, ...]:
    """``layers`` in Sonar's index, or a ConfigError naming ``field`` when one is outside the target."""
    layers = tuple(layers)
    outside = [k for k in layers if not 0 <= k <= num_layers]
    if outside:
        raise ConfigError(
            field,
            f"{source} asks for target hidden states {list(outside)}, outside the target's 0..{num_layers} "
            f"(0 is the embeddings, {num_layers} the last of its {num_layers} layers)",
            "use a draft trained for this target (its layer ids must fit the target's depth)",
        )
    if len(set(layers)) != len(layers):
        raise ConfigError(field, f"{source} names a target layer twice: {list(layers)}", "list each layer once")
    return layers
