"""``aphrodite serve --tensor-parallel-size 2`` as a process: it serves what one rank serves, SIGTERM
stops every worker with the server, and a rank that dies fails requests with its error, never a hang."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from server_live import engine_kwargs
from test_server_run import ServerProcess

from sonar_core.testing.losslessness import greedy_outputs

BODY = {"prompt": [5, 6, 7, 8, 5, 6], "max_tokens": 12, "temperature": 0, "ignore_eos": True}


def _children(pid: int) -> list[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _gone(pids: list[int], timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not any(Path(f"/proc/{p}").exists() for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture
def split_server(checkpoint: Path):
    server = ServerProcess({**engine_kwargs(checkpoint), "tensor_parallel_size": 2})
    try:
        yield server
    finally:
        if server.proc.poll() is None:
            server.proc.kill()


def test_a_split_server_serves_what_one_rank_does_and_sigterm_stops_its_workers(
    checkpoint: Path, tokenizer, split_server
):
    base_url = f"http://127.0.0.1:{split_server.port()}"
    with httpx.Client(base_url=base_url, timeout=60) as http:
        response = http.post("/v1/completions", json=BODY)
    assert response.status_code == 200, response.text
    (expected,), _ = greedy_outputs(checkpoint, [BODY["prompt"]], max_tokens=12)
    assert response.json()["choices"][0]["text"] == tokenizer.decode(expected)
    workers = _children(split_server.proc.pid)
    assert len(workers) == 1
    split_server.proc.send_signal(signal.SIGTERM)
    assert split_server.wait() == 0, split_server.stderr
    assert _gone(workers), "a tensor-parallel worker outlived the server"
    assert "Traceback" not in split_server.stderr


def test_a_dead_rank_fails_requests_and_health_with_its_error(split_server):
    base_url = f"http://127.0.0.1:{split_server.port()}"
    (worker,) = _children(split_server.proc.pid)
    os.kill(worker, signal.SIGKILL)
    started = time.monotonic()
    with httpx.Client(base_url=base_url, timeout=60) as http:
        response = http.post("/v1/completions", json=BODY)
        assert response.status_code >= 500
        assert "tensor-parallel rank 1 failed" in response.text
        health = http.get("/health")
    assert time.monotonic() - started < 30
    assert health.status_code == 503 and "tensor-parallel rank 1 failed" in health.text
