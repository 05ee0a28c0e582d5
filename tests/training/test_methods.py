"""Each method's head trains on the tiny target's data (its loss falls), is written in its
published layout, loads in its plugin, and leaves greedy output exactly as without speculation."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from training_kit import SETTINGS, make_trainer

from sonar_core.testing.losslessness import greedy_outputs
from sonar_core.training.dataset import StreamingDataset
from sonar_core.training.loop import train
from sonar_core.training.methods import METHODS
from sonar_core.training.methods.base import HeadTrainer


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(2, 30))] for _ in range(6)]


def _first_batch_loss(trainer: HeadTrainer, dataset: StreamingDataset) -> float:
    sequences = dataset.load(dataset.batches(SETTINGS.seed, 0)[0], trainer.layers, final=True)
    with torch.no_grad():
        return trainer.batch_loss(sequences, torch.Generator().manual_seed(0)).loss.item()


@pytest.fixture(scope="module")
def plain_output(target: Path) -> list[list[int]]:
    return greedy_outputs(target, _prompts(), max_num_seqs=4)[0]


@pytest.mark.parametrize("method", list(METHODS))
def test_head_learns_loads_in_its_plugin_and_keeps_greedy_output(
    method, tmp_path, target, dataset, training_target, plain_output
):
    trainer = make_trainer(method, training_target, dataset)
    before = _first_batch_loss(trainer, dataset)
    outcome = train(trainer, dataset, SETTINGS, tmp_path / "state.pt", {"method": method})
    assert outcome.finished and outcome.steps_done > 10
    assert _first_batch_loss(trainer, dataset) < 0.95 * before

    head = trainer.export(tmp_path / "head", torch.float32)
    config = {"method": method, "model": str(head), "num_speculative_tokens": 3}
    tokens, llm = greedy_outputs(target, _prompts(), config, max_num_seqs=4)
    assert tokens == plain_output
    assert llm.get_spec_decode_metrics().num_draft_tokens > 0


def test_chained_accuracy_counts_drafts_whose_earlier_drafts_were_right_too():
    from sonar_core.training.methods.base import PositionLoss

    def logits(tokens: list[int]) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(tokens), 4).float()

    losses = PositionLoss(3)
    # Rows 0..3 draft position 0 (rows 0, 1, 3 right); rows 0, 1, 3 go on (0 and 3 right); then 0, 3.
    losses.add(0, logits([1, 2, 3, 0]), torch.tensor([1, 2, 0, 0]), torch.tensor([0, 1, 2, 3]))
    losses.add(1, logits([1, 1, 2]), torch.tensor([1, 0, 2]), torch.tensor([0, 1, 3]))
    losses.add(2, logits([3, 3]), torch.tensor([0, 3]), torch.tensor([0, 3]))
    result = losses.result(torch.nn.Linear(1, 1))
    assert result.counts == [4, 3, 2] and result.correct == [3, 2, 1] and result.chained == [3, 2, 1]
    losses = PositionLoss(2)
    losses.add(0, logits([1, 2]), torch.tensor([1, 0]), torch.tensor([0, 1]))
    losses.add(1, logits([1, 2]), torch.tensor([0, 2]), torch.tensor([0, 1]))  # row 1 right after a wrong draft
    assert losses.result(torch.nn.Linear(1, 1)).chained == [1, 0]


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_reports_chained_accuracy(method, dataset, training_target):
    trainer = make_trainer(method, training_target, dataset)
    sequences = dataset.load(dataset.batches(SETTINGS.seed, 0)[0], trainer.layers, final=True)
    with torch.no_grad():
        result = trainer.batch_loss(sequences, torch.Generator().manual_seed(0))
    assert result.chained[0] == result.correct[0]
    assert all(c <= r for c, r in zip(result.chained, result.correct, strict=True))
    assert all(a >= b for a, b in zip(result.chained, result.chained[1:], strict=False))
