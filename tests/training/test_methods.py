"""Each method's head trains on the tiny target's data (its loss falls), is written in its
published layout, loads in its plugin, and leaves greedy output exactly as without speculation."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from training_kit import DRAFT_VOCAB, SETTINGS, make_trainer

from sonar_core.testing.losslessness import greedy_outputs
from sonar_core.training.dataset import StreamingDataset
from sonar_core.training.loop import train
from sonar_core.training.methods import METHODS
from sonar_core.training.methods.base import HeadOptions, HeadTrainer, PositionLoss, RowTargets


def _prompts() -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 512) for _ in range(rng.randint(2, 30))] for _ in range(6)]


def _first_batch_loss(trainer: HeadTrainer, dataset: StreamingDataset) -> float:
    sequences = dataset.load(dataset.batches(SETTINGS.seed, 0)[0], trainer.layers, final=True)
    with torch.no_grad():
        return trainer.batch_loss(sequences, torch.Generator().manual_seed(0)).loss.item()


def _train_and_check_the_loss_falls(trainer: HeadTrainer, dataset: StreamingDataset, tmp_path: Path, method: str) -> None:
    before = _first_batch_loss(trainer, dataset)
    outcome = train(trainer, dataset, SETTINGS, tmp_path / "state.pt", {"method": method})
    assert outcome.finished and outcome.steps_done > 10
    assert _first_batch_loss(trainer, dataset) < 0.95 * before


@pytest.fixture(scope="module")
def plain_output(target: Path) -> list[list[int]]:
    return greedy_outputs(target, _prompts(), max_num_seqs=4)[0]


@pytest.mark.parametrize("method", list(METHODS))
def test_head_learns_loads_in_its_plugin_and_keeps_greedy_output(
    method, tmp_path, target, dataset, training_target, plain_output
):
    trainer = make_trainer(method, training_target, dataset)
    _train_and_check_the_loss_falls(trainer, dataset, tmp_path, method)

    head = trainer.export(tmp_path / "head", torch.float32)
    config = {"method": method, "model": str(head), "num_speculative_tokens": 3}
    tokens, llm = greedy_outputs(target, _prompts(), config, max_num_seqs=4)
    assert tokens == plain_output
    assert llm.get_spec_decode_metrics().num_draft_tokens > 0


def test_chained_accuracy_counts_drafts_whose_earlier_drafts_were_right_too():
    def logits(tokens: list[int]) -> torch.Tensor:
        return torch.nn.functional.one_hot(torch.tensor(tokens), 4).float()

    def choices(tokens: list[int]) -> RowTargets:
        return RowTargets(torch.tensor(tokens))

    losses = PositionLoss(3)
    # Rows 0..3 draft position 0 (rows 0, 1, 3 right); rows 0, 1, 3 go on (0 and 3 right); then 0, 3.
    losses.add(0, logits([1, 2, 3, 0]), choices([1, 2, 0, 0]), torch.tensor([0, 1, 2, 3]))
    losses.add(1, logits([1, 1, 2]), choices([1, 0, 2]), torch.tensor([0, 1, 3]))
    losses.add(2, logits([3, 3]), choices([0, 3]), torch.tensor([0, 3]))
    result = losses.result(torch.nn.Linear(1, 1))
    assert result.counts == [4, 3, 2] and result.correct == [3, 2, 1] and result.chained == [3, 2, 1]
    losses = PositionLoss(2)
    losses.add(0, logits([1, 2]), choices([1, 0]), torch.tensor([0, 1]))
    losses.add(1, logits([1, 2]), choices([0, 2]), torch.tensor([0, 1]))  # row 1 right after a wrong draft
    assert losses.result(torch.nn.Linear(1, 1)).chained == [1, 0]


def test_distribution_targets_are_the_targets_softmax_over_the_heads_vocabulary(dataset, training_target):
    choice = make_trainer("eagle3", training_target, dataset)
    trainer = make_trainer("eagle3", training_target, dataset, labels="distribution")
    final = dataset.load(dataset.batches(SETTINGS.seed, 0)[0], trainer.layers, final=True)[0].final
    targets = trainer.row_targets(final)
    logits = final.float() @ trainer.lm_head_rows.float().T
    assert logits.shape[1] == DRAFT_VOCAB
    torch.testing.assert_close(targets.probabilities, torch.softmax(logits, dim=-1))
    assert torch.equal(targets.choices, logits.argmax(-1))
    plain = choice.row_targets(final)
    assert plain.probabilities is None and torch.equal(plain.choices, targets.choices)
    rows = torch.tensor([2, 0])
    assert torch.equal(targets[rows].probabilities, targets.probabilities[rows])
    with pytest.raises(ValueError, match="labels must be one of choice, distribution"):
        HeadOptions(labels="soft")


def test_the_distribution_loss_is_the_cross_entropy_against_the_targets_probabilities():
    generator = torch.Generator().manual_seed(3)
    logits = torch.randn(5, 7, generator=generator)
    probabilities = torch.softmax(torch.randn(5, 7, generator=generator) * 2, dim=-1)
    choices = probabilities.argmax(-1)
    rows = torch.arange(5)
    soft = PositionLoss(1)
    soft.add(0, logits, RowTargets(choices, probabilities), rows)
    expected = -(probabilities * torch.log_softmax(logits, dim=-1)).sum(-1).mean()
    torch.testing.assert_close(soft.result(torch.nn.Linear(1, 1)).loss, expected)
    # One-hot probabilities: the choice loss exactly.
    one_hot, hard = PositionLoss(1), PositionLoss(1)
    one_hot.add(0, logits, RowTargets(choices, torch.nn.functional.one_hot(choices, 7).float()), rows)
    hard.add(0, logits, RowTargets(choices), rows)
    torch.testing.assert_close(one_hot.result(torch.nn.Linear(1, 1)).loss, hard.result(torch.nn.Linear(1, 1)).loss)
    # The loss is least where the head's distribution is the target's.
    matched = PositionLoss(1)
    matched.add(0, probabilities.log(), RowTargets(choices, probabilities), rows)
    assert matched.result(torch.nn.Linear(1, 1)).loss < expected


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_learns_the_targets_distribution(method, tmp_path, dataset, training_target):
    trainer = make_trainer(method, training_target, dataset, labels="distribution")
    _train_and_check_the_loss_falls(trainer, dataset, tmp_path, method)


@pytest.mark.parametrize("method", list(METHODS))
def test_every_method_reports_chained_accuracy(method, dataset, training_target):
    trainer = make_trainer(method, training_target, dataset)
    sequences = dataset.load(dataset.batches(SETTINGS.seed, 0)[0], trainer.layers, final=True)
    with torch.no_grad():
        result = trainer.batch_loss(sequences, torch.Generator().manual_seed(0))
    assert result.chained[0] == result.correct[0]
    assert all(c <= r for c, r in zip(result.chained, result.correct, strict=True))
    assert all(a >= b for a, b in zip(result.chained, result.chained[1:], strict=False))
