"""``run_server`` as a process: startup failures without tracebacks, graceful SIGINT/SIGTERM."""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from server_live import engine_kwargs

from sonar_core.config import EngineConfig
from sonar_core.entrypoints.openai.server import run_server

SERVE = """
import json, sys
from types import SimpleNamespace
from sonar_core.config import EngineConfig
from sonar_core.entrypoints.openai.server import run_server
args = SimpleNamespace(host="127.0.0.1", port=0, api_key=None, served_model_name=None)
sys.exit(run_server(EngineConfig(**json.loads(sys.argv[1])), args))
"""
READY = re.compile(r"serving .* on http://127\.0\.0\.1:(\d+)")


class ServerProcess:
    """``run_server`` in a child process; stderr is collected on a thread so the pipe never fills."""

    def __init__(self, config: dict) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", SERVE, json.dumps(config)], stderr=subprocess.PIPE, text=True
        )
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self.lines.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self.lines)

    def port(self, timeout: float = 90.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines:
                if match := READY.search(line):
                    return int(match.group(1))
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"the server did not start:\n{self.stderr}")

    def wait(self, timeout: float = 60.0) -> int:
        code = self.proc.wait(timeout)
        self._reader.join(10)
        return code


@pytest.mark.parametrize(
    "sig",
    # Uvicorn handles both alike; the second one costs another process start, so it runs with -m slow.
    [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
    ids=["SIGTERM", "SIGINT"],
)
def test_a_signal_lets_the_stream_in_flight_finish_then_exits_0(checkpoint: Path, sig: signal.Signals) -> None:
    server = ServerProcess(engine_kwargs(checkpoint))
    try:
        base_url = f"http://127.0.0.1:{server.port()}"
        first_chunk = threading.Event()
        payloads: list[str] = []

        def stream() -> None:
            body = {"prompt": "hello", "max_tokens": 100, "temperature": 0, "stream": True, "ignore_eos": True}
            with httpx.Client(base_url=base_url, timeout=60) as http:
                with http.stream("POST", "/v1/completions", json=body) as response:
                    for line in response.iter_lines():
                        if line.startswith("data: "):
                            payloads.append(line.removeprefix("data: "))
                            first_chunk.set()

        reader = threading.Thread(target=stream)
        reader.start()
        assert first_chunk.wait(60)
        server.proc.send_signal(sig)
        reader.join(60)
        assert server.wait() == 0, server.stderr
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert "".join(c["choices"][0]["text"] for c in chunks)
    assert "Traceback" not in server.stderr


def test_a_model_that_cannot_load_exits_with_one_message(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = SimpleNamespace(host="127.0.0.1", port=0, api_key=None, served_model_name=None)
    code = run_server(EngineConfig(model=str(tmp_path / "no-such-model"), device="cpu"), args)
    # 2 when the loader reports it as a configuration error (a path that does not exist), 1 otherwise.
    assert code in (1, 2)
    err = capsys.readouterr().err
    assert err.startswith("aphrodite serve: error: ")
    assert "no-such-model" in err
    assert "Traceback" not in err


def test_a_busy_port_fails_before_the_model_loads(capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = SimpleNamespace(host="127.0.0.1", port=port, api_key=None, served_model_name=None)
        # The model does not exist either: reaching it would fail differently.
        assert run_server(EngineConfig(model="/no/such/model"), args) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"aphrodite serve: error: cannot listen on 127.0.0.1:{port}")
    assert "already in use" in err and "--port" in err
