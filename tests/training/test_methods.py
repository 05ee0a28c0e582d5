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
