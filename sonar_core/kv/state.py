"""Per-request state of recurrent layers (linear attention), beside the paged KV cache.

A gated-DeltaNet layer (Qwen3-Next) keeps no per-token keys: each request carries a fixed-size
state instead, the last ``kernel - 1`` inputs of its causal convolution and a recurrent matrix per
value head. Speculation breaks the paged cache's easy rollback here: a verification step advances
the state through every drafted token, and a rejection must restore the state after the last
accepted one. So a row that carries drafts does not overwrite its committed state; the layer
writes the state after each of its last ``keep_positions`` tokens into a per-position scratch, and
:meth:`RecurrentStateCache.commit` copies the accepted position's state over the committed one
once the rejection sampler has decided. Every other row (prefill chunks, plain decode) writes its
final state directly, which is how chunked prefill carries the state from one chunk to the next.

Slots are handed out per request (:meth:`RecurrentStateCache.acquire`) and given back when it
finishes, is aborted or is preempted; a row whose first token is at position 0 starts from a zero
state, so a preempted request that is recomputed never reads what its old slot held.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class StateLayerSpec:
    """The per-request state of one recurrent layer: ``conv_shape`` in the model's dtype (the
    convolution's input window), ``recurrent_shape`` in float32 (the recurrence accumulates over
    the whole sequence, so it is kept at full precision, as the reference implementation does)."""

    conv_shape: tuple[int, ...]
    recurrent_shape: tuple[int, ...]

    def bytes_per_request(self, dtype: torch.dtype, positions: int) -> int:
        """Memory of one request's state plus ``positions`` scratch copies of it."""
        conv = math.prod(self.conv_shape) * torch.empty((), dtype=dtype).element_size()
        recurrent = math.prod(self.recurrent_shape) * 4
        return (conv + recurrent) * (1 + positions)


@dataclass
class LayerState:
    """One layer's tensors: the committed state per slot, and the per-position scratch of rows
    that carry drafts (``[num_slots, max_positions, ...]``; empty without speculation)."""

    conv: torch.Tensor
    recurrent: torch.Tensor
    conv_positions: torch.Tensor
    recurrent_positions: torch.Tensor


class RecurrentStateCache:
    """The states of every recurrent layer for ``num_slots`` requests, and which request holds
    which slot. ``max_positions`` is the most tokens of one row whose states a verification step
    keeps (``num_speculative_tokens + 1``; 0 without speculation)."""

    def __init__(
        self,
        specs: list[StateLayerSpec],
        num_slots: int,
        max_positions: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.specs = list(specs)
        self.num_slots = num_slots
        self.max_positions = max_positions
        self.layers = [
            LayerState(
                conv=torch.zeros((num_slots, *spec.conv_shape), dtype=dtype, device=device),
                recurrent=torch.zeros((num_slots, *spec.recurrent_shape), dtype=torch.float32, device=device),
                conv_positions=torch.zeros((num_slots, max_positions, *spec.conv_shape), dtype=dtype, device=device),
                recurrent_positions=torch.zeros(
                    (num_slots, max_positions, *spec.recurrent_shape), dtype=torch.float32, device=device
                ),
            )
            for spec in specs
        ]
        self._free = list(range(num_slots - 1, -1, -1))
        self._slot_of: dict[str, int] = {}

    @staticmethod
    def memory_bytes(specs: list[StateLayerSpec], num_slots: int, max_positions: int, dtype: torch.dtype) -> int:
        """What :class:`RecurrentStateCache` allocates for these arguments (for the memory plan)."""
        return num_slots * sum(spec.bytes_per_request(dtype, max_positions) for spec in specs)

    def acquire(self, request_id: str) -> int:
        """The slot of ``request_id``, taking a free one on its first step."""
        slot = self._slot_of.get(request_id)
        if slot is None:
            if not self._free:
                raise RuntimeError(f"no free recurrent-state slot for request {request_id!r} ({self.num_slots} in use)")
            slot = self._slot_of[request_id] = self._free.pop()
        return slot

    def release(self, request_id: str) -> None:
        """Give back the slot of a request that finished, was aborted or was preempted."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._free.append(slot)

    @property
    def num_free_slots(self) -> int:
        return len(self._free)

    def commit(self, slots: list[int], positions: list[int]) -> None:
        """Make the state after scratch position ``positions[i]`` the committed state of
        ``slots[i]`` (the accepted length of that request's drafts), in every layer."""
        if not slots:
            return
        device = self.layers[0].conv.device if self.layers else "cpu"
        slot_index = torch.tensor(slots, dtype=torch.long, device=device)
        position_index = torch.tensor(positions, dtype=torch.long, device=device)
        for layer in self.layers:
            layer.conv.index_copy_(0, slot_index, layer.conv_positions[slot_index, position_index])
            layer.recurrent.index_copy_(0, slot_index, layer.recurrent_positions[slot_index, position_index])


@dataclass
class StateBatch:
    """What recurrent layers need to know about one step's rows (sequences), in batch order."""

    cache: RecurrentStateCache
    # The slot of each row.
    slots: list[int]
    # Whether each row continues a state (its first token is not at position 0); False rows start
    # from zeros whatever their slot holds.
    has_initial_state: list[bool]
    # Per row: how many of its last tokens are uncommitted (the last accepted token and the
    # drafts, len(drafts) + 1); their states go to the scratch positions 0.. and the committed
    # state is left alone. 0: the row's final state is committed directly.
    keep_positions: list[int]
