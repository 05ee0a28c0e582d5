"""The exporter: a proposer that drafts nothing and keeps each request's target states.

The states come from the target's normal forward (the engine captures them for any proposer that
asks), so exporting costs no extra forward: per step, one row gather and one copy to the host per
request. When a request finishes with a complete output its file is written (see
:mod:`sonar_core.spec_decode.hidden_state_files`); an aborted or preempted request's rows are
dropped (a preempted one is recomputed and exported whole later).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from sonar_core.spec_decode.hidden_state_files import HiddenStateRecord, write_hidden_states
from sonar_core.spec_decode.proposer import (
    DraftProposal,
    ProposeBatch,
    Proposer,
    ProposerCapabilities,
    ProposerRequestError,
)


@dataclass
class _Rows:
    """A request's exported rows so far: chunks of consecutive positions, on the host."""

    prompt_length: int
    aux: list[torch.Tensor] = field(default_factory=list)  # [r, len(layers), H] per chunk
    final: list[torch.Tensor] = field(default_factory=list)  # [r, H] per chunk
    num_rows: int = 0


class HiddenStateExporter(Proposer):
    """Writes ``<directory>/<request id>.safetensors`` for every request that completes."""

    def __init__(self, directory: Path, layers: tuple[int, ...], include_final: bool, model: str) -> None:
        self.directory = Path(directory)
        self.layers = layers
        self.include_final = include_final
        self.model = model
        self.capabilities = ProposerCapabilities(
            target_hidden_layers=layers, target_final_hidden=include_final, max_depth=0
        )
        self._rows: dict[str, _Rows] = {}

    def add_request(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self._rows[request_id] = _Rows(prompt_length=len(prompt_token_ids))

    def remove_request(self, request_id: str) -> None:
        self._rows.pop(request_id, None)

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> DraftProposal:
        hidden = batch.target_hidden
        for request in batch.requests:
            rows = self._rows[request.request_id]
            if request.hidden_start != rows.num_rows:
                raise RuntimeError(
                    f"request {request.request_id}: target states for position {request.hidden_start} arrived after "
                    f"{rows.num_rows} exported rows"
                )
            span = request.hidden_rows
            if hidden.aux is not None:
                chunk = hidden.aux[span].reshape(-1, len(self.layers), hidden.hidden_size)
                rows.aux.append(chunk.to("cpu", copy=True))
            if hidden.final is not None:
                rows.final.append(hidden.final[span].to("cpu", copy=True))
            rows.num_rows += request.num_hidden_rows
        return DraftProposal([[] for _ in batch.requests])

    def finish_request(self, request_id: str, token_ids: list[int]) -> None:
        """Write the request's file; a write that fails (disk full, permissions) fails the request."""
        rows = self._rows.pop(request_id)
        if rows.num_rows != len(token_ids) - 1:
            raise ProposerRequestError(
                f"the export of request {request_id} holds {rows.num_rows} positions, not {len(token_ids) - 1}"
            )
        record = HiddenStateRecord(
            request_id=request_id,
            token_ids=torch.tensor(token_ids, dtype=torch.int64),
            prompt_length=rows.prompt_length,
            layer_ids=self.layers,
            hidden_states=torch.cat(rows.aux) if rows.aux else None,
            final_hidden_states=torch.cat(rows.final) if rows.final else None,
            model=self.model,
        )
        try:
            write_hidden_states(self.directory, record)
        except OSError as exc:
            raise ProposerRequestError(
                f"its hidden states could not be written to {self.directory}: {exc.strerror or exc}"
            ) from exc
