"""A tiny random target and its self-distillation data, built once per session."""

from __future__ import annotations

from pathlib import Path

import pytest
from training_kit import SETTINGS, TARGET_LAYERS, data_spec

from sonar_core.testing.checkpoints import CheckpointFactory
from sonar_core.training.data import SelfDistillationData
from sonar_core.training.dataset import StreamingDataset
from sonar_core.training.target import TrainingTarget


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    return CheckpointFactory(tmp_path_factory.mktemp("training-checkpoints"))


@pytest.fixture(scope="session")
def target(checkpoints: CheckpointFactory) -> Path:
    return checkpoints.get("llama", num_layers=TARGET_LAYERS)


@pytest.fixture(scope="session")
def data_dir(tmp_path_factory: pytest.TempPathFactory, target: Path) -> Path:
    """The target's answers to 16 prompts with their hidden states."""
    folder = tmp_path_factory.mktemp("training-data") / "data"
    SelfDistillationData(folder).generate(data_spec(target))
    return folder


@pytest.fixture(scope="session")
def dataset(data_dir: Path, target: Path) -> StreamingDataset:
    files = SelfDistillationData(data_dir).files(data_spec(target))
    return StreamingDataset(files, SETTINGS.max_rows, SETTINGS.batch_rows)


@pytest.fixture(scope="session")
def training_target(target: Path) -> TrainingTarget:
    return TrainingTarget.load(str(target))
