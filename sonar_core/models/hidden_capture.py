"""Capturing residual-stream states of the target during its normal forward, for proposers.

Index convention (Sonar's own, equal to vLLM's capture ids): state ``k`` is the residual stream
after ``k`` decoder layers. ``0`` is the token embedding, ``L`` (the number of layers) is the last
layer's output before the final norm. ``sonar_core.spec_decode.layer_ids`` converts the other
published conventions (Hugging Face ``hidden_states`` indices, DFlash target layer ids) to it.

The states land in one persistent buffer, a column block per requested state in the order the
proposer asked for them, so an EAGLE-3 head reads its concatenated input as a plain view: nothing
is concatenated or allocated per step.
"""

from __future__ import annotations

import torch


class HiddenStateCapture:
    """The buffer a target forward writes its requested states into.

    ``buffer`` is ``[max_tokens, len(layers) * hidden_size]``; after a forward over ``T`` tokens,
    rows ``:T`` hold that step's states, row ``i`` for the flat batch's token ``i``.
    """

    def __init__(
        self,
        layers: tuple[int, ...],
        num_layers: int,
        hidden_size: int,
        max_tokens: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if len(set(layers)) != len(layers):
            raise ValueError(f"hidden-state layers must not repeat, got {layers}")
        outside = [k for k in layers if not 0 <= k <= num_layers]
        if outside:
            raise ValueError(
                f"hidden-state layers {outside} are outside 0..{num_layers} (0: embeddings, "
                f"{num_layers}: the last layer's output)"
            )
        self.layers = layers
        self.hidden_size = hidden_size
        self.buffer = torch.zeros(max_tokens, len(layers) * hidden_size, dtype=dtype, device=device)
        self._columns = {k: slice(i * hidden_size, (i + 1) * hidden_size) for i, k in enumerate(layers)}

    def wants(self, index: int) -> bool:
        return index in self._columns

    def record(self, index: int, hidden: torch.Tensor) -> None:
        """Store the state after ``index`` layers (``[T, hidden_size]``) when it was requested."""
        columns = self._columns.get(index)
        if columns is not None:
            self.buffer[: hidden.shape[0], columns].copy_(hidden)

    def columns(self, index: int) -> slice:
        """The buffer columns of state ``index``."""
        return self._columns[index]
