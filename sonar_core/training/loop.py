"""The optimisation loop: AdamW, warm-up then cosine decay, resumable and deterministic.

Everything a step depends on is a function of the seed and the step number: the batch (the
dataset's seeded order), the random draws of the step (a generator seeded per step), the learning
rate (the schedule). The state file holds the head, the optimiser and the step, written whole or
not at all every ``save_every`` steps and at the end; a run started again with the same settings
continues from it and ends with the same weights as a run that was never interrupted.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from sonar_core.errors import ConfigError
from sonar_core.training.dataset import StreamingDataset
from sonar_core.training.methods.base import HeadTrainer

STATE_VERSION = 1


@dataclass(frozen=True)
class TrainSettings:
    """How the head is optimised."""

    epochs: int = 4
    learning_rate: float = 1e-3
    weight_decay: float = 0.0
    warmup_steps: int = 20
    # Rows (positions) per batch, and most rows taken from one sequence.
    batch_rows: int = 1024
    max_rows: int = 640
    grad_clip: float = 1.0
    seed: int = 0
    save_every: int = 25


@dataclass
class StepRecord:
    """One step's figures, kept in the state file."""

    step: int
    loss: float
    # Teacher-forced accuracy per draft position (see BatchLoss).
    accuracy: list[float]
    rows: int
    # Per draft position: the share of drafts right there and at every earlier position (BatchLoss).
    chained: list[float] = field(default_factory=list)


@dataclass
class TrainOutcome:
    steps_done: int
    total_steps: int
    history: list[StepRecord] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        return self.steps_done >= self.total_steps

    def recent_accuracy(self, steps: int = 20, chained: bool = False) -> list[float]:
        """Per-position accuracy (or chained accuracy) over the last ``steps`` steps."""
        recent = [r.chained if chained else r.accuracy for r in self.history[-steps:]]
        if not recent or not recent[0]:
            return []
        return [sum(r[p] for r in recent) / len(recent) for p in range(len(recent[0]))]


def learning_rate(settings: TrainSettings, step: int, total: int) -> float:
    """Linear warm-up to ``learning_rate``, then cosine decay to a tenth of it at ``total``."""
    if step < settings.warmup_steps:
        return settings.learning_rate * (step + 1) / settings.warmup_steps
    progress = (step - settings.warmup_steps) / max(1, total - settings.warmup_steps)
    return settings.learning_rate * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, progress))))


def train(
    trainer: HeadTrainer,
    dataset: StreamingDataset,
    settings: TrainSettings,
    state_file: Path,
    fingerprint: dict[str, Any],
    *,
    stop_after: int | None = None,
    on_step: Callable[[StepRecord, int, int], None] | None = None,
) -> TrainOutcome:
    """Train ``trainer``'s head over ``dataset``, resuming from ``state_file`` when it holds a run
    with the same ``fingerprint`` (the settings, the head and the data). ``stop_after`` ends this
    call after that many steps (the run stays resumable); ``on_step(record, done, total)`` reports
    each step."""
    schedule = [(epoch, batch) for epoch in range(settings.epochs) for batch in dataset.batches(settings.seed, epoch)]
    total = len(schedule)
    parameters = trainer.trainable_parameters()
    optimizer = torch.optim.AdamW(parameters, lr=settings.learning_rate, weight_decay=settings.weight_decay)
    fingerprint = {**fingerprint, "settings": asdict(settings), "batches": total}
    outcome = TrainOutcome(0, total)
    if state_file.is_file():
        outcome = _resume(state_file, trainer, optimizer, fingerprint, total)
    trainer.module.train()
    layers = trainer.layers
    stop = total if stop_after is None else min(total, outcome.steps_done + stop_after)
    while outcome.steps_done < stop:
        step = outcome.steps_done
        _, indices = schedule[step]
        sequences = dataset.load(indices, layers, final=True)
        generator = torch.Generator().manual_seed(settings.seed * 1_000_003 + step)
        for group in optimizer.param_groups:
            group["lr"] = learning_rate(settings, step, total)
        optimizer.zero_grad(set_to_none=True)
        result = trainer.batch_loss(sequences, generator)
        result.loss.backward()
        if settings.grad_clip:
            torch.nn.utils.clip_grad_norm_(parameters, settings.grad_clip)
        optimizer.step()
        record = StepRecord(
            step=step,
            loss=result.loss.item(),
            accuracy=[c / n if n else 0.0 for c, n in zip(result.correct, result.counts, strict=True)],
            rows=sum(s.num_rows for s in sequences),
            chained=[c / n if n else 0.0 for c, n in zip(result.chained, result.counts, strict=True)],
        )
        outcome.history.append(record)
        outcome.steps_done += 1
        if outcome.steps_done % settings.save_every == 0 or outcome.steps_done == stop:
            _save(state_file, trainer, optimizer, fingerprint, outcome)
        if on_step is not None:
            on_step(record, outcome.steps_done, total)
    trainer.module.eval()
    return outcome


def _save(
    path: Path, trainer: HeadTrainer, optimizer: torch.optim.Optimizer, fingerprint: dict[str, Any], outcome: TrainOutcome
) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.partial")
    state = {
        "version": STATE_VERSION,
        "fingerprint": json.dumps(fingerprint, sort_keys=True),
        "steps_done": outcome.steps_done,
        "module": trainer.module.state_dict(),
        "optimizer": optimizer.state_dict(),
        "history": [asdict(r) for r in outcome.history],
        "saved_at": time.time(),
    }
    torch.save(state, partial)
    os.replace(partial, path)


def _resume(
    path: Path, trainer: HeadTrainer, optimizer: torch.optim.Optimizer, fingerprint: dict[str, Any], total: int
) -> TrainOutcome:
    state = torch.load(path, map_location="cpu", weights_only=True)
    if state.get("version") != STATE_VERSION or state.get("fingerprint") != json.dumps(fingerprint, sort_keys=True):
        raise ConfigError(
            "work_dir",
            f"{path} holds a training run with other settings, head or data",
            "delete it to start over, or run with the settings it was started with",
        )
    trainer.module.load_state_dict(state["module"])
    optimizer.load_state_dict(state["optimizer"])
    history = [StepRecord(**r) for r in state["history"]]
    return TrainOutcome(int(state["steps_done"]), total, history)
