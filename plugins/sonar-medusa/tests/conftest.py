"""A tiny target and Medusa heads in the published layouts, built once per session."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from sonar_core.testing.checkpoints import build_tiny_checkpoint
from sonar_core.testing.medusa_heads import build_medusa_head


@pytest.fixture(scope="session")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("medusa-target"), arch="llama", num_layers=2)


@pytest.fixture(scope="session")
def make_heads(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Path]:
    built: dict[str, Path] = {}
    root = tmp_path_factory.mktemp("medusa-heads")

    def make(target_dir: Path, **options: Any) -> Path:
        key = repr((str(target_dir), sorted(options.items())))
        if key not in built:
            built[key] = build_medusa_head(target_dir, root / f"heads{len(built)}", **options)
        return built[key]

    return make
