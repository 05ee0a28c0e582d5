"""Fixtures of the benchmark tests: a tiny checkpoint and a fake peer engine."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from bench_fakes import FAKE_PEER

from sonar_core.bench.peers import PEERS, PeerEngine
from sonar_core.testing.checkpoints import build_tiny_checkpoint


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("bench-target"), arch="llama", num_layers=2)


@pytest.fixture
def fake_peer() -> Iterator[PeerEngine]:
    PEERS[FAKE_PEER.name] = FAKE_PEER
    try:
        yield FAKE_PEER
    finally:
        PEERS.pop(FAKE_PEER.name, None)
