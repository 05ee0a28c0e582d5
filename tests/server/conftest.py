"""Fixtures of the server tests: a tokenizer for the stand-in engine, a tiny checkpoint, live servers.

The live servers run a real engine on a tiny random Llama checkpoint; ``offline`` is a second
engine on the same checkpoint behind the Python API, the reference the server must match.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from server_live import NGRAM_CONFIG, LiveServer, engine_kwargs, make_engine, serve_in_thread

from sonar_core.testing.checkpoints import build_bytelevel_tokenizer, build_tiny_checkpoint


@pytest.fixture(scope="session")
def tokenizer() -> Any:
    """A real byte-level BPE tokenizer with a ChatML template (no model needed)."""
    return build_bytelevel_tokenizer(512)


@pytest.fixture(scope="session")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("server-model"), arch="llama", num_layers=2)


@pytest.fixture(scope="session")
def live(checkpoint: Path) -> Iterator[LiveServer]:
    """One server for the whole session; tests that read counters wait for it to be idle first."""
    with serve_in_thread(make_engine(checkpoint), served_model_name="tiny") as server:
        yield server


@pytest.fixture(scope="session")
def live_ngram(checkpoint: Path) -> Iterator[LiveServer]:
    with serve_in_thread(make_engine(checkpoint, speculative_config=NGRAM_CONFIG), served_model_name="tiny") as server:
        yield server


@pytest.fixture(scope="session")
def offline(checkpoint: Path) -> Any:
    from sonar_core.entrypoints.llm import LLM

    return LLM(**engine_kwargs(checkpoint))
