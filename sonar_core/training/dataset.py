"""Training sequences streamed from the exported hidden-state files, a batch at a time.

Only the file headers are read up front (lengths, prompt lengths); a batch's tensors are read when
the batch is trained on and dropped after it, so memory is bounded by one batch whatever the size
of the data. The order of batches is a function of the seed and the epoch alone, which is what
makes an interrupted run resume exactly where it stopped.

A sequence of ``n`` rows is a file cut to its first ``n`` positions: row ``t`` holds the target's
states at position ``t`` and its next token ``token_ids[t + 1]``; the target's distribution at row
``t`` (its LM head over ``final[t]``) is what a draft learns to predict for token ``t + 1``. Every
position teaches: in the prompt too, the target's own choice is the label (measured here: adding the
prompt positions raised held-out accuracy more than the extra steps cost).
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from sonar_core.spec_decode.hidden_state_files import checked_metadata


@dataclass(frozen=True)
class RecordInfo:
    """One file's shape, from its header."""

    path: Path
    num_rows: int  # positions with states (tokens - 1)
    prompt_length: int
    layer_ids: tuple[int, ...]


@dataclass
class TrainingSequence:
    """One record cut to at most ``max_rows`` rows (see the module docstring)."""

    token_ids: torch.Tensor  # [n + 1] int64
    aux: torch.Tensor | None  # [n, len(layers) * H] float32, the requested layers side by side
    final: torch.Tensor | None  # [n, H] float32

    @property
    def num_rows(self) -> int:
        return int(self.token_ids.shape[0]) - 1


class StreamingDataset:
    """Records of a data folder, batched by rows; see the module docstring."""

    def __init__(self, files: list[Path], max_rows: int, batch_rows: int) -> None:
        if max_rows < 2 or batch_rows < 2:
            raise ValueError("max_rows and batch_rows must be at least 2")
        self.max_rows = max_rows
        self.batch_rows = batch_rows
        self.records = [_read_info(path) for path in files]
        if not self.records:
            raise ValueError("no data files")

    @property
    def layer_ids(self) -> tuple[int, ...]:
        return self.records[0].layer_ids

    def batches(self, seed: int, epoch: int) -> list[list[int]]:
        """The epoch's batches as lists of record indices: records in a seeded random order,
        packed greedily up to ``batch_rows`` rows (a longer record forms a batch of its own)."""
        order = list(range(len(self.records)))
        random.Random(f"sonar-train-draft/{seed}/{epoch}").shuffle(order)
        batches: list[list[int]] = []
        current: list[int] = []
        rows = 0
        for index in order:
            size = min(self.records[index].num_rows, self.max_rows)
            if current and rows + size > self.batch_rows:
                batches.append(current)
                current, rows = [], 0
            current.append(index)
            rows += size
        if current:
            batches.append(current)
        return batches

    def load(self, indices: list[int], layers: tuple[int, ...] | None, final: bool) -> list[TrainingSequence]:
        """The sequences of ``indices``, with the states of ``layers`` (Sonar's index, in that column
        order) and/or the final states, as float32."""
        return [self._load(self.records[i], layers, final) for i in indices]

    def _load(self, info: RecordInfo, layers: tuple[int, ...] | None, final: bool) -> TrainingSequence:
        rows = min(info.num_rows, self.max_rows)
        with safe_open(str(info.path), framework="pt", device="cpu") as f:
            token_ids = f.get_slice("token_ids")[: rows + 1].to(torch.int64)
            aux = None
            if layers:
                missing = [k for k in layers if k not in info.layer_ids]
                if missing:
                    raise ValueError(f"{info.path} holds target states {list(info.layer_ids)}, not {missing}")
                states = f.get_slice("hidden_states")[:rows]
                columns = [info.layer_ids.index(k) for k in layers]
                aux = states[:, columns].reshape(rows, -1).float()
            final_states = f.get_slice("final_hidden_states")[:rows].float() if final else None
        return TrainingSequence(token_ids, aux, final_states)

    def answer_token_counts(self, vocab_size: int) -> torch.Tensor:
        """``[vocab_size]`` int64: how often each token occurs in the answers (what drafts predict)."""
        counts = torch.zeros(vocab_size, dtype=torch.int64)
        for info in self.records:
            with safe_open(str(info.path), framework="pt", device="cpu") as f:
                answer = f.get_slice("token_ids")[info.prompt_length :].to(torch.int64)
            counts += torch.bincount(answer, minlength=vocab_size)[:vocab_size]
        return counts


def _read_info(path: Path) -> RecordInfo:
    with safe_open(str(path), framework="pt", device="cpu") as f:
        metadata = checked_metadata(path, f)
        names = set(f.keys())
        if "final_hidden_states" not in names:
            raise ValueError(f"{path} has no final_hidden_states; export with include_final")
        num_tokens = f.get_slice("token_ids").get_shape()[0]
        return RecordInfo(
            path=Path(path),
            num_rows=num_tokens - 1,
            prompt_length=int(metadata["prompt_length"]),
            layer_ids=tuple(json.loads(metadata["layer_ids"])),
        )
