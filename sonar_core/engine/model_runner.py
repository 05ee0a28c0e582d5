"""Flattens a scheduled batch, runs the target model once, and returns the rows to sample from."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sonar_core.engine.scheduler import SchedulerOutput
from sonar_core.layers.attention import AttentionMetadata


@dataclass
class ModelRunOutput:
    """Logits of the positions the step samples from, and captured hidden states.

    For every scheduled request that samples this step, ``logits_rows[i]`` is the slice of
    ``logits`` holding its rows: one per draft position, then the bonus/next-token row
    (``len(drafts) + 1`` rows). Requests in the middle of a chunked prefill get an empty slice.
    """

    logits: torch.Tensor  # [num_sample_rows, vocab] float32
    logits_rows: list[slice]  # per scheduled request, rows of `logits`
    hidden_rows: list[slice]  # per scheduled request, rows of the flat batch (captured states)
    captured: dict[int, torch.Tensor]  # layer -> [num_tokens, hidden] for requested layers


class ModelRunner:
    """Runs the target on one flattened batch that mixes prefill chunks, decodes and drafts."""

    def __init__(
        self,
        model: torch.nn.Module,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        block_size: int,
        device: torch.device,
        capture_layers: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.device = device
        self.capture_layers = capture_layers

    @torch.inference_mode()
    def execute(self, sched: SchedulerOutput) -> ModelRunOutput:
        input_ids: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        block_tables: list[list[int]] = []
        sample_index: list[int] = []
        logits_rows: list[slice] = []
        hidden_rows: list[slice] = []
        for item in sched.scheduled:
            seq = item.seq
            start = seq.num_computed_tokens
            tokens = seq.all_token_ids[start : start + item.num_new_tokens] + item.draft_token_ids
            flat_start = len(input_ids)
            input_ids.extend(tokens)
            query_lens.append(len(tokens))
            seq_lens.append(start + len(tokens))
            block_tables.append(seq.block_table)
            hidden_rows.append(slice(flat_start, len(input_ids)))
            row_start = len(sample_index)
            if item.samples:
                num_rows = len(item.draft_token_ids) + 1
                sample_index.extend(range(len(input_ids) - num_rows, len(input_ids)))
            logits_rows.append(slice(row_start, len(sample_index)))
        metadata = AttentionMetadata.build(
            query_lens, seq_lens, block_tables, self.block_size, self.device
        )
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        hidden, captured = self.model(
            ids, metadata.positions, self.kv_caches, metadata, capture_layers=self.capture_layers
        )
        index = torch.tensor(sample_index, dtype=torch.long, device=self.device)
        logits = self.model.compute_logits(hidden.index_select(0, index))
        return ModelRunOutput(logits, logits_rows, hidden_rows, captured)
