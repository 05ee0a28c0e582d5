"""Tiny target and draft checkpoints shared by the speculative-decoding tests."""

from pathlib import Path

import pytest

from sonar_core.testing.checkpoints import build_tiny_checkpoint, build_truncated_draft


@pytest.fixture(scope="session")
def target_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("target"), arch="llama", num_layers=2)


@pytest.fixture(scope="session")
def draft_dir(target_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_truncated_draft(target_dir, tmp_path_factory.mktemp("draft"), num_layers=1)
