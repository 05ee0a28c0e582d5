"""``aphrodite train-draft`` end to end: data, vocabulary, training, the checkpoint, its acceptance.

Steps, each resumable (run the same command again after an interruption):

1. **data** (``<work_dir>/data``): the target answers the training prompts; their hidden states
   are exported (:mod:`sonar_core.training.data`);
2. **vocabulary**: the draft vocabulary, the most frequent answer tokens (EAGLE-3, Medusa);
3. **train** (``<work_dir>/<method>-state.pt``): the head's loss through its own forward
   (:mod:`sonar_core.training.loop`);
4. **export**: the head in its method's published layout, at ``output``, which the method's
   plugin loads as ``{"method": METHOD, "model": OUTPUT}``;
5. **evaluate**: mean acceptance length and per-position acceptance of the written head on
   held-out prompts of the same domains, through the engine.

Timings and figures go to ``<work_dir>/<method>-report.json``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from sonar_core.errors import ConfigError
from sonar_core.training.data import DataSpec, SelfDistillationData, held_out_prompts
from sonar_core.training.dataset import StreamingDataset
from sonar_core.training.loop import StepRecord, TrainSettings, train
from sonar_core.training.methods import build_trainer, reduces_vocabulary
from sonar_core.training.methods.base import HeadOptions, HeadTrainer
from sonar_core.training.target import TrainingTarget, draft_vocabulary

logger = logging.getLogger(__name__)

SAVE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# Files an export writes; an existing output folder holding anything else is never replaced.
_EXPORTED = frozenset({"config.json", "model.safetensors"})


@dataclass(frozen=True)
class DraftRecipe:
    """Everything one training run is made of."""

    method: str
    output: Path
    work_dir: Path
    data: DataSpec
    head: HeadOptions
    settings: TrainSettings
    eval_prompts: int = 32
    eval_max_tokens: int = 128
    save_dtype: str = "float32"
    # A head written earlier to start from (fine tuning on more data) instead of the initialisation.
    init_from: Path | None = None


@dataclass
class Report:
    """What a run did, how long each step took, and how well the head drafts."""

    method: str
    output: str | None = None
    timings: dict[str, float] = field(default_factory=dict)  # seconds per step
    data: dict[str, Any] = field(default_factory=dict)
    training: dict[str, Any] = field(default_factory=dict)
    evaluation: dict[str, Any] = field(default_factory=dict)


class Progress:
    """Progress bars with ETA for the data and training steps (nothing when disabled)."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._bar: Any = None
        self._started = 0.0
        self._tokens = 0

    def data(self, done: int, total: int, tokens: int) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=done, desc="data (prompts answered)", unit="prompt")
            self._started = time.perf_counter()
            return
        self._tokens += tokens
        self._bar.update(done - self._bar.n)
        elapsed = time.perf_counter() - self._started
        self._bar.set_postfix(tokens_per_s=f"{self._tokens / max(elapsed, 1e-9):.0f}", refresh=False)

    def prompts(self, done: int, total: int) -> None:
        """The target writing its own prompts (a bar of its own, closed when the answers start)."""
        if not self.enabled:
            return
        if self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=done, desc="data (prompts written)", unit="prompt")
            return
        self._bar.update(done - self._bar.n)
        if done >= total:
            self.close()

    def step(self, record: StepRecord, done: int, total: int) -> None:
        if not self.enabled:
            return
        if self._bar is None:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=total, initial=done - 1, desc="train (steps)", unit="step")
        self._bar.update(1)
        accuracy = "/".join(f"{a:.2f}" for a in record.accuracy)
        self._bar.set_postfix(loss=f"{record.loss:.3f}", acc=accuracy, refresh=False)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        self._bar = None
        self._tokens = 0


def run(recipe: DraftRecipe, *, progress: bool = True, stop_after: int | None = None) -> Report:
    """Run every step of ``recipe`` (see the module docstring); ``stop_after`` ends training after
    that many steps of this call, leaving it resumable and writing no checkpoint."""
    report = Report(recipe.method)
    bars = Progress(progress)
    work = Path(recipe.work_dir)
    _check_output(Path(recipe.output))

    started = time.perf_counter()
    data = SelfDistillationData(work / "data")
    generated = data.generate(recipe.data, progress=bars.data, prompt_progress=bars.prompts)
    bars.close()
    report.timings["data"] = time.perf_counter() - started
    files = data.files(recipe.data)
    dataset = StreamingDataset(files, recipe.settings.max_rows, recipe.settings.batch_rows)
    report.data = {"prompts": len(files), "generated_now": generated, "records": len(dataset.records),
                   "positions": sum(r.num_rows for r in dataset.records),
                   "answer_tokens": sum(r.num_rows + 1 - r.prompt_length for r in dataset.records)}

    started = time.perf_counter()
    target = TrainingTarget.load(recipe.data.model)
    counts = dataset.answer_token_counts(target.vocab_size)
    size = recipe.head.draft_vocab_size if reduces_vocabulary(recipe.method) else None
    vocab = draft_vocabulary(counts, min(size or target.vocab_size, target.vocab_size))
    report.data["draft_vocab_size"] = int(vocab.numel())
    report.data["draft_vocab_coverage"] = float(counts[vocab].sum()) / max(1, int(counts.sum()))
    torch.manual_seed(recipe.settings.seed)
    trainer = build_trainer(recipe.method, target, recipe.head, vocab, dataset.layer_ids, _mask_token(counts))
    if recipe.init_from is not None:
        trainer.start_from(Path(recipe.init_from))
    report.timings["prepare"] = time.perf_counter() - started

    started = time.perf_counter()
    state_file = work / f"{recipe.method}-state.pt"
    # Settings added later enter the fingerprint only when not at their default, so a run started
    # before they existed still resumes.
    head = asdict(recipe.head)
    labels = head.pop("labels")
    fingerprint = {"method": recipe.method, "head": head, "data": recipe.data.comparable(),
                   "prompts": recipe.data.num_prompts, "vocab": vocab.tolist()}
    if labels != HeadOptions().labels:
        fingerprint["labels"] = labels
    for count in ("conversation_prompts", "generated_prompts"):
        if getattr(recipe.data, count):
            fingerprint[count] = getattr(recipe.data, count)
    if recipe.init_from is not None:
        fingerprint["init_from"] = _weights_digest(Path(recipe.init_from))
    outcome = train(trainer, dataset, recipe.settings, state_file, fingerprint, stop_after=stop_after,
                    on_step=bars.step)
    bars.close()
    report.timings["train"] = time.perf_counter() - started
    report.training = {
        "steps_done": outcome.steps_done,
        "total_steps": outcome.total_steps,
        "trainable_parameters": sum(p.numel() for p in trainer.trainable_parameters()),
        "first_loss": outcome.history[0].loss if outcome.history else None,
        "last_loss": outcome.history[-1].loss if outcome.history else None,
        # On the last training batches: each position fed the right earlier tokens, and chained
        # (every earlier draft right too, what greedy verification accepts). The held-out
        # evaluation below is the figure that counts.
        "teacher_forced_accuracy": outcome.recent_accuracy(),
        "teacher_forced_chained": outcome.recent_accuracy(chained=True),
    }
    if not outcome.finished:
        logger.info("training stopped after %d of %d steps; run the same command to continue",
                    outcome.steps_done, outcome.total_steps)
        _write_report(work, report)
        return report

    report.output = str(_export(trainer, Path(recipe.output), SAVE_DTYPES[recipe.save_dtype]))

    if recipe.eval_prompts:
        started = time.perf_counter()
        prompts = held_out_prompts(recipe.data, recipe.eval_prompts, data.spare(recipe.data))
        report.evaluation = acceptance(recipe, [list(p.messages) for p in prompts])
        report.timings["evaluate"] = time.perf_counter() - started
    _write_report(work, report)
    return report


def acceptance(recipe: DraftRecipe, conversations: list[list[dict[str, str]]]) -> dict[str, Any]:
    """Greedy acceptance of the written head on ``conversations``, through the engine."""
    from sonar_core.entrypoints.llm import LLM
    from sonar_core.sampling_params import SamplingParams

    speculative = {"method": recipe.method, "model": str(recipe.output), "num_speculative_tokens": recipe.head.depth}
    llm = LLM(model=recipe.data.model, dtype=recipe.data.dtype, max_num_seqs=recipe.data.max_num_seqs,
              speculative_config=speculative)
    llm.chat(conversations, SamplingParams(temperature=0.0, max_tokens=recipe.eval_max_tokens), use_tqdm=False)
    summary = llm.get_spec_decode_metrics()
    return {
        "prompts": len(conversations),
        "num_speculative_tokens": recipe.head.depth,
        "mean_acceptance_length": summary.mean_acceptance_length,
        "per_position_acceptance_rate": summary.per_position_acceptance_rate,
    }


def _check_output(output: Path) -> None:
    """The output folder must be new, or hold only an earlier export (which is replaced)."""
    if output.exists() and (not output.is_dir() or {p.name for p in output.iterdir()} - _EXPORTED):
        raise ConfigError(
            "output", f"{str(output)!r} exists and holds other files than a trained head",
            "choose a new folder (the head is written there)",
        )


def _export(trainer: HeadTrainer, output: Path, dtype: torch.dtype) -> Path:
    """Write the head beside ``output``, then put it in place (an earlier export is replaced)."""
    _check_output(output)
    partial = output.with_name(output.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    trainer.export(partial, dtype)
    if output.exists():
        for name in _EXPORTED:
            (output / name).unlink(missing_ok=True)
        output.rmdir()
    partial.rename(output)
    return output


def _weights_digest(head_dir: Path) -> str:
    """What identifies a head to start from: a digest of its weights."""
    digest = hashlib.sha256()
    for path in sorted(head_dir.glob("*.safetensors")):
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _mask_token(counts: torch.Tensor) -> int:
    """DFlash's mask token: the last id that no answer uses (it only marks slots to fill)."""
    unused = torch.nonzero(counts == 0).squeeze(1)
    return int(unused[-1]) if unused.numel() else int(counts.shape[0] - 1)


def _write_report(work: Path, report: Report) -> None:
    path = work / f"{report.method}-report.json"
    path.write_text(json.dumps(asdict(report), indent=2) + "\n")
