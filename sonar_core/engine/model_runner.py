"""Flattens a scheduled batch, runs the target model once, and returns the rows to sample from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonar_core.engine.scheduler import SchedulerOutput
from sonar_core.kv import RecurrentStateCache, StateBatch
from sonar_core.layers.attention import AttentionMetadata
from sonar_core.models.base import CausalLM
from sonar_core.models.hidden_capture import HiddenStateCapture
from sonar_core.spec_decode.proposer import TargetHiddenStates


@dataclass
class ModelRunOutput:
    """Logits of the positions the step samples from, and the hidden states proposers read.

    For every scheduled request that samples this step, ``logits_rows[i]`` is the slice of
    ``logits`` holding its rows: one per draft position, then the bonus/next-token row
    (``len(drafts) + 1`` rows). Requests in the middle of a chunked prefill get an empty slice.
    """

    logits: torch.Tensor  # [num_sample_rows, vocab] float32
    logits_rows: list[slice]  # per scheduled request, rows of `logits`
    query_rows: list[slice]  # per scheduled request, its rows of the flat batch (tokens, then drafts)
    start_positions: list[int]  # per scheduled request, the position of its first row
    hidden: TargetHiddenStates | None  # every row of the flat batch; None when no proposer asks
    # Per scheduled request, per draft branch: its rows of ``logits`` and of the flat batch (the
    # newest token again, then the branch's drafts), laid out like the request's own.
    branch_logits_rows: list[list[slice]]
    branch_query_rows: list[list[slice]]


class ModelRunner:
    """Runs the target on one flattened batch that mixes prefill chunks, decodes and drafts.

    When the proposer reads target states, the forward writes the requested residual-stream
    states into one persistent buffer (``capture``), and the final normed states are kept; both
    cover every token of the step, prefill chunks included.

    Models with linear-attention layers get each row's recurrent-state slot (``state_cache``);
    a row with drafts keeps the states after each of its uncommitted tokens, and
    :meth:`commit_states` makes the accepted one the request's state once verification is done.
    """

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        capture: HiddenStateCapture | None = None,
        keep_final_hidden: bool = False,
        state_cache: RecurrentStateCache | None = None,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.capture = capture
        self.keep_final_hidden = keep_final_hidden
        self.state_cache = state_cache

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunOutput:
        input_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_index: list[int] = []
        logits_rows: list[slice] = []
        query_rows: list[slice] = []
        start_positions: list[int] = []
        branch_logits_rows: list[list[slice]] = []
        branch_query_rows: list[list[slice]] = []
        for item in sched.scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            tokens = seq.all_token_ids[start : start + item.num_new_tokens] + item.draft_token_ids
            flat_start = len(input_ids)
            input_ids.extend(tokens)
            query_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            block_tables.append(seq.block_table)
            query_rows.append(slice(flat_start, len(input_ids)))
            start_positions.append(start)
            row_start = len(sample_index)
            if item.samples:
                num_rows = len(item.draft_token_ids) + 1
                sample_index.extend(range(len(input_ids) - num_rows, len(input_ids)))
            logits_rows.append(slice(row_start, len(sample_index)))
            branch_logits_rows.append([])
            branch_query_rows.append([])
            for branch in item.draft_branches:
                branch_tokens = tokens[:1] + branch.token_ids
                branch_logits_rows[-1].append(slice(len(sample_index), len(sample_index) + len(branch_tokens)))
                branch_query_rows[-1].append(slice(len(input_ids), len(input_ids) + len(branch_tokens)))
                sample_index.extend(range(len(input_ids), len(input_ids) + len(branch_tokens)))
                input_ids.extend(branch_tokens)
                query_lens.append(len(branch_tokens))
                seq_lens.append(start + len(branch_tokens))
                block_tables.append(branch.fork.block_table)
        metadata = AttentionMetadata.build(
            query_lens, seq_lens, block_tables, self.block_size, self.device
        )
        if self.state_cache is not None:
            metadata.state = self._state_batch(sched, start_positions)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        hidden = self.model(ids, metadata.positions, self.kv_caches, metadata, capture=self.capture)
        index = torch.tensor(sample_index, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        return ModelRunOutput(
            logits,
            logits_rows,
            query_rows,
            start_positions,
            self._hidden(hidden, len(input_ids)),
            branch_logits_rows,
            branch_query_rows,
        )

    def _state_batch(self, sched: SchedulerOutput, start_positions: list[int]) -> StateBatch:
        cache = self.state_cache
        assert cache is not None
        return StateBatch(
            cache=cache,
            slots=[cache.acquire(item.seq.request_id) for item in sched.scheduled],
            has_initial_state=[start > 0 for start in start_positions],
            keep_positions=[len(item.draft_token_ids) + 1 if item.draft_token_ids else 0 for item in sched.scheduled],
        )

    def commit_states(self, sched: SchedulerOutput, num_accepted: list[int]) -> None:
        """For every request that verified drafts this step, make the recurrent state after its
        last accepted token (scratch position ``num_accepted``) its committed state."""
        if self.state_cache is None:
            return
        verified = [
            (self.state_cache.acquire(item.seq.request_id), accepted)
            for item, accepted in zip(sched.scheduled, num_accepted, strict=True)
            if item.draft_token_ids
        ]
        self.state_cache.commit([slot for slot, _ in verified], [accepted for _, accepted in verified])

    def _hidden(self, final: torch.Tensor, num_tokens: int) -> TargetHiddenStates | None:
        if self.capture is None and not self.keep_final_hidden:
            return None
        capture = self.capture
        return TargetHiddenStates(
            layers=capture.layers if capture is not None else (),
            hidden_size=final.shape[-1],
            aux=capture.buffer[:num_tokens] if capture is not None else None,
            final=final if self.keep_final_hidden else None,
        )
