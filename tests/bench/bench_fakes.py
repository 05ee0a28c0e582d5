"""The fake peer engine of the benchmark tests (its worker is ``fake_peer_worker.py``)."""

from __future__ import annotations

from pathlib import Path

from sonar_core.bench.peers import PeerEngine

FAKE_WORKER = Path(__file__).resolve().parent / "fake_peer_worker.py"
FAKE_PEER = PeerEngine(
    name="fake",
    title="Fake peer",
    worker=str(FAKE_WORKER),
    venv=None,
    module="json",
    install="nothing to install",
    modes={None: frozenset(), "echo": frozenset({"num_speculative_tokens"})},
    concurrent_modes=frozenset(),
)
