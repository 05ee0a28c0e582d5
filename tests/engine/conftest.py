"""A tiny target checkpoint and an engine factory for the engine tests."""

from collections.abc import Callable
from pathlib import Path

import pytest

from aphrodite import LLM
from sonar_core.testing.checkpoints import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("engine-target"), arch="qwen3", num_layers=2)


@pytest.fixture
def make_llm(tiny_model: Path) -> Callable[..., LLM]:
    def make(**engine_args) -> LLM:
        engine_args.setdefault("dtype", "float32")
        engine_args.setdefault("device", "cpu")
        return LLM(model=str(tiny_model), **engine_args)

    return make
