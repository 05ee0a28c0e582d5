"""One step's rows as recurrent (linear-attention) layers see them, and the state traffic of each.

The engine describes the rows in ``attn_metadata.state`` (a :class:`~sonar_core.kv.StateBatch`);
:meth:`RecurrentBatch.build` turns that into index tensors once per forward, and every
linear-attention layer of the model reuses them. Per row ``b`` (the rows of ``query_start_loc``):

- it starts from the committed state of ``slots[b]`` when ``has_initial_state[b]``, else from zeros
  (whatever the slot holds);
- with ``keep_positions[b] == 0`` its final convolution window and recurrent state become the
  slot's committed state;
- with ``keep_positions[b] == K > 0`` the committed state is left alone and the states after each
  of its last ``K`` tokens go to the slot's scratch positions ``0..K-1``, for
  :meth:`~sonar_core.kv.RecurrentStateCache.commit` to pick the accepted one.

Short rows (decode, verification of drafts, and every row that keeps positions) run the delta rule
token by token, all together, padded to the longest of them; longer rows (prefill chunks) run the
chunked form one row at a time. The causal convolution covers every row in one pass: the rows'
state windows and the step's tokens sit in one buffer, and each token's ``kernel`` taps are rows
of it (:attr:`RecurrentBatch.conv_taps`), so a row's first tokens read its window.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from sonar_core.kv import LayerState, StateBatch
from sonar_core.layers.attention import AttentionMetadata
from sonar_core.layers.delta_rule import chunked_gated_delta_rule, recurrent_gated_delta_rule

# Rows of at most this many tokens run the token-by-token form: a few steps cost less than the
# triangular solve of a chunk.
RECURRENT_MAX_TOKENS = 4


@dataclass
class RecurrentBatch:
    """Index tensors of one step (see the module docstring); build with :meth:`build`.

    The convolution buffer of a step holds each row's window (``kernel - 1`` rows per batch row,
    oldest first) and then the step's tokens in flat-batch order; ``conv_taps[j, t]`` is the
    buffer row that tap ``j`` of token ``t`` reads.
    """

    state: StateBatch
    conv_kernel: int
    slots: torch.Tensor  # [B] slot of each row
    fresh: torch.Tensor  # [B] bool: starts from zeros
    conv_taps: torch.Tensor  # [kernel, T] buffer rows
    # Rows that commit their final state (keep_positions 0): slot and final window (buffer rows).
    commit_slots: torch.Tensor  # [Bc]
    commit_windows: torch.Tensor  # [Bc * (kernel - 1)]
    # Kept positions, all rows together: flat scratch index (slot * max_positions + position) and
    # the window after that position's token.
    keep_targets: torch.Tensor  # [P]
    keep_windows: torch.Tensor  # [P * (kernel - 1)]
    # (row, first token, tokens, slot) of each row run in the chunked form.
    chunked_rows: list[tuple[int, int, int, int]]
    # The token-by-token rows: their indices among the rows, their tokens (flat index) and where
    # each lands in the padded [rows, recurrent_len] layout.
    recurrent_rows: torch.Tensor  # [Br]
    recurrent_tokens: torch.Tensor  # [Tr]
    recurrent_padded: torch.Tensor  # [Tr]
    recurrent_len: int
    # Those of them that commit: index among the token-by-token rows, and slot.
    recurrent_commit_rows: torch.Tensor
    recurrent_commit_slots: torch.Tensor
    # Per kept position (the order of keep_targets): its token's index in the padded layout.
    keep_states: torch.Tensor  # [P]

    @classmethod
    def build(cls, metadata: AttentionMetadata, conv_kernel: int) -> RecurrentBatch:
        """The plan of ``metadata``'s rows; reads ``query_start_loc`` back to the host once.

        ValueError when ``metadata.state`` is missing or does not describe the rows.
        """
        state = metadata.state
        if state is None:
            raise ValueError(
                "this model has linear-attention layers: attn_metadata.state must describe the step's "
                "recurrent-state slots (a StateBatch over a RecurrentStateCache of the model's state_specs())"
            )
        starts = metadata.query_start_loc.tolist()
        lengths = [end - start for start, end in zip(starts[:-1], starts[1:], strict=True)]
        num_rows = len(lengths)
        if not len(state.slots) == len(state.has_initial_state) == len(state.keep_positions) == num_rows:
            raise ValueError(
                f"the StateBatch describes {len(state.slots)} slots, {len(state.has_initial_state)} "
                f"initial-state flags and {len(state.keep_positions)} keep counts for {num_rows} rows"
            )
        max_positions = state.cache.max_positions
        for row, (keep, length) in enumerate(zip(state.keep_positions, lengths, strict=True)):
            if not 0 <= keep <= min(length, max_positions):
                raise ValueError(
                    f"row {row}: keep_positions {keep} must be in 0..min(its {length} tokens, the cache's "
                    f"{max_positions} positions)"
                )

        window = conv_kernel - 1
        token_base = num_rows * window

        def buffer_rows(row: int, inputs: torch.Tensor) -> torch.Tensor:
            """Buffer rows of row ``row``'s inputs ``inputs`` (token offsets; negative: its window)."""
            return torch.where(inputs >= 0, token_base + starts[row] + inputs, row * window + window + inputs)

        taps, commit_slots, commit_windows, keep_targets, keep_windows = [], [], [], [], []
        chunked_rows, recurrent_rows = [], []
        rows = zip(lengths, state.slots, state.keep_positions, strict=True)
        for row, (length, slot, keep) in enumerate(rows):
            offsets = torch.arange(length)
            taps.append(buffer_rows(row, offsets[None, :] - window + torch.arange(conv_kernel)[:, None]))
            if keep:
                last = torch.arange(length - keep, length)  # the kept tokens
                window_inputs = last[:, None] - window + 1 + torch.arange(window)[None, :]
                keep_windows.append(buffer_rows(row, window_inputs))
                keep_targets.append(slot * max_positions + torch.arange(keep))
            else:
                commit_slots.append(slot)
                commit_windows.append(buffer_rows(row, torch.arange(length - window, length)))
            if keep or length <= RECURRENT_MAX_TOKENS:
                recurrent_rows.append(row)
            else:
                chunked_rows.append((row, starts[row], length, slot))

        padded_len = max((lengths[row] for row in recurrent_rows), default=0)
        recurrent_tokens, recurrent_padded, keep_states = [], [], []
        commit_rows, recurrent_commit_slots = [], []
        for index, row in enumerate(recurrent_rows):
            length, keep = lengths[row], state.keep_positions[row]
            recurrent_tokens.append(starts[row] + torch.arange(length))
            recurrent_padded.append(index * padded_len + torch.arange(length))
            if keep:
                keep_states.append(index * padded_len + torch.arange(length - keep, length))
            else:
                commit_rows.append(index)
                recurrent_commit_slots.append(state.slots[row])

        device = metadata.query_start_loc.device

        def ids(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64).to(device, non_blocking=True)

        def joined(parts: list[torch.Tensor]) -> torch.Tensor:
            if not parts:
                return torch.zeros(0, dtype=torch.int64, device=device)
            return torch.cat([part.reshape(-1) for part in parts]).to(device, non_blocking=True)

        return cls(
            state=state,
            conv_kernel=conv_kernel,
            slots=ids(list(state.slots)),
            fresh=torch.tensor([not flag for flag in state.has_initial_state]).to(device, non_blocking=True),
            conv_taps=torch.cat(taps, dim=1).to(device, non_blocking=True),
            commit_slots=ids(commit_slots),
            commit_windows=joined(commit_windows),
            keep_targets=joined(keep_targets),
            keep_windows=joined(keep_windows),
            chunked_rows=chunked_rows,
            recurrent_rows=ids(recurrent_rows),
            recurrent_tokens=joined(recurrent_tokens),
            recurrent_padded=joined(recurrent_padded),
            recurrent_len=padded_len,
            recurrent_commit_rows=ids(commit_rows),
            recurrent_commit_slots=ids(recurrent_commit_slots),
            keep_states=joined(keep_states),
        )

    def layer_state(self, index: int) -> LayerState:
        """The tensors of recurrent layer ``index`` (its place among the model's state specs)."""
        return self.state.cache.layers[index]

    def convolve(
        self,
        x: torch.Tensor,
        weight: torch.Tensor,
        layer: LayerState,
        activation: Callable[[torch.Tensor], torch.Tensor],
    ) -> torch.Tensor:
        """``activation`` of the depthwise causal convolution of ``x`` ``[T, C]`` (every token's
        input) with ``weight`` ``[C, kernel]``, each row continuing its window; stores the rows'
        windows as the module docstring says. Accumulates in float32 and rounds once to ``x``'s
        dtype before the activation, as a convolution kernel does."""
        channels, window = x.shape[1], self.conv_kernel - 1
        windows = layer.conv.index_select(0, self.slots).masked_fill_(self.fresh[:, None, None], 0)
        buffer = torch.cat((windows.transpose(1, 2).reshape(-1, channels), x.to(windows.dtype)), dim=0)
        acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
        for tap in range(self.conv_kernel):
            acc.addcmul_(buffer.index_select(0, self.conv_taps[tap]).float(), weight[:, tap].float())
        if self.commit_slots.numel():
            final = buffer.index_select(0, self.commit_windows).view(-1, window, channels).transpose(1, 2)
            layer.conv.index_copy_(0, self.commit_slots, final)
        if self.keep_targets.numel():
            kept = buffer.index_select(0, self.keep_windows).view(-1, window, channels).transpose(1, 2)
            layer.conv_positions.flatten(0, 1).index_copy_(0, self.keep_targets, kept)
        return activation(acc.to(x.dtype))

    def gated_delta_rule(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        layer: LayerState,
    ) -> torch.Tensor:
        """The delta rule (:mod:`sonar_core.layers.delta_rule`) over every row from its initial
        state, storing the rows' states; ``q``/``k`` ``[T, H, Dk]``, ``v`` ``[T, H, Dv]``,
        ``g``/``beta`` ``[T, H]``, all float32. Returns the outputs ``[T, H, Dv]``."""
        initial = layer.recurrent.index_select(0, self.slots).masked_fill_(self.fresh[:, None, None, None], 0)
        out = torch.empty_like(v)
        for row, start, length, slot in self.chunked_rows:
            tokens = slice(start, start + length)
            out[tokens], final = chunked_gated_delta_rule(
                q[tokens], k[tokens], v[tokens], g[tokens], beta[tokens], initial[row]
            )
            layer.recurrent[slot].copy_(final)
        if self.recurrent_len:
            self._token_by_token(q, k, v, g, beta, initial, out, layer)
        return out

    def _token_by_token(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        g: torch.Tensor,
        beta: torch.Tensor,
        initial: torch.Tensor,
        out: torch.Tensor,
        layer: LayerState,
    ) -> None:
        """The token-by-token rows together, padded to the longest; writes their outputs into
        ``out`` and stores their states."""
        rows, length = self.recurrent_rows.numel(), self.recurrent_len

        def padded(x: torch.Tensor) -> torch.Tensor:
            # Zero padding: g = 0 and beta = 0 leave a finished row's state as it is.
            flat = x.new_zeros(rows * length, *x.shape[1:])
            flat.index_copy_(0, self.recurrent_padded, x.index_select(0, self.recurrent_tokens))
            return flat.view(rows, length, *x.shape[1:])

        outputs, states = recurrent_gated_delta_rule(
            *(padded(x) for x in (q, k, v, g, beta)), initial.index_select(0, self.recurrent_rows)
        )
        outputs = outputs.flatten(0, 1).index_select(0, self.recurrent_padded)
        out.index_copy_(0, self.recurrent_tokens, outputs)
        if self.recurrent_commit_slots.numel():
            final = states[-1].index_select(0, self.recurrent_commit_rows)
            layer.recurrent.index_copy_(0, self.recurrent_commit_slots, final)
        if self.keep_targets.numel():
            every = torch.stack(states, dim=1).flatten(0, 1)
            kept = every.index_select(0, self.keep_states)
            layer.recurrent_positions.flatten(0, 1).index_copy_(0, self.keep_targets, kept)
