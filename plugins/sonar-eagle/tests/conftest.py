"""Tiny targets and random EAGLE heads in the published layouts, built once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sonar_core.testing.checkpoints import CheckpointFactory
from sonar_core.testing.eagle_heads import build_eagle_head

# Eight layers, so that EAGLE-3's default states (2, L/2, L-3) = (2, 4, 5) are distinct.
TARGET_LAYERS = 8


@pytest.fixture(scope="session")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> CheckpointFactory:
    return CheckpointFactory(tmp_path_factory.mktemp("eagle-checkpoints"))


@pytest.fixture(scope="session")
def target(checkpoints: CheckpointFactory) -> Path:
    return checkpoints.get("llama", num_layers=TARGET_LAYERS)


@pytest.fixture(scope="session")
def qwen3_target(checkpoints: CheckpointFactory) -> Path:
    return checkpoints.get("qwen3", num_layers=TARGET_LAYERS, head_dim=32)


@pytest.fixture(scope="session")
def make_head(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    """``make_head(target, **build_eagle_head options)``: each distinct head built once."""
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("eagle-heads")

    def make(target_dir: Path, **options: Any) -> Path:
        key = repr((str(target_dir), sorted(options.items())))
        if key not in built:
            built[key] = build_eagle_head(target_dir, root / f"head{len(built)}", **options)
        return built[key]

    return make
