"""Flattens a scheduled batch, runs the target model once, and returns the rows to sample from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonar_core.engine.scheduler import SchedulerOutput
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


class ModelRunner:
    """Runs the target on one flattened batch that mixes prefill chunks, decodes and drafts.

    When the proposer reads target states, the forward writes the requested residual-stream
    states into one persistent buffer (``capture``), and the final normed states are kept; both
    cover every token of the step, prefill chunks included.
    """

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        capture: HiddenStateCapture | None = None,
        keep_final_hidden: bool = False,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.capture = capture
        self.keep_final_hidden = keep_final_hidden

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
        metadata = AttentionMetadata.build(
            query_lens, seq_lens, block_tables, self.block_size, self.device
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        hidden = self.model(ids, metadata.positions, self.kv_caches, metadata, capture=self.capture)
        index = torch.tensor(sample_index, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        return ModelRunOutput(logits, logits_rows, query_rows, start_positions, self._hidden(hidden, len(input_ids)))

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
