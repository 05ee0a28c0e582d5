"""``aphrodite serve`` started by the benchmark, one per speculative configuration, on a free
loopback port; stopped (SIGINT, as a user would) when the row is done."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any

from sonar_core.bench.http_client import Endpoint, HTTPBenchError

STARTUP_TIMEOUT_S = 900.0  # a cold model load on a busy 2-core machine takes minutes
STOP_TIMEOUT_S = 30.0
_SERVE = "from sonar_core.entrypoints.cli import main; raise SystemExit(main())"


def engine_flags(engine_args: dict[str, Any]) -> list[str]:
    """Command-line flags of engine settings (``max_num_seqs=4`` -> ``--max-num-seqs 4``)."""
    flags: list[str] = []
    for name, value in engine_args.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool) and not value and _tri_state(name):
            flags.append("--no-" + name.replace("_", "-"))
        elif isinstance(value, bool):
            flags += [flag] if value else []
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def _tri_state(name: str) -> bool:
    """An engine switch whose unset default lets the engine decide, so false needs ``--no-X``."""
    from sonar_core.config import EngineConfig

    field = EngineConfig.model_fields.get(name)
    return field is not None and field.default is None


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class ServerProcess:
    """A server of its own for one row; use as a context manager."""

    def __init__(self, args: list[str], env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.command = [sys.executable, "-c", _SERVE, "serve", *args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.env = env
        self.log_path = log_path
        self.endpoint = Endpoint(f"http://127.0.0.1:{self.port}")
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def __enter__(self) -> ServerProcess:
        self._log = open(self.log_path, "wb")  # closed in __exit__
        self._process = subprocess.Popen(
            self.command, env=self.env, stdin=subprocess.DEVNULL, stdout=self._log, stderr=subprocess.STDOUT
        )
        try:
            self._wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self._process is not None and self._process.poll() is not None:
                raise HTTPBenchError(f"the server exited with status {self._process.returncode}: {self.log_tail()}")
            try:
                status, _ = self.endpoint.get("/health")
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.5)
        raise HTTPBenchError(f"the server did not become ready in {STARTUP_TIMEOUT_S:.0f} s: {self.log_tail()}")

    @property
    def pid(self) -> int:
        if self._process is None:
            raise RuntimeError("the server has not been started")
        return self._process.pid

    def peak_rss_bytes(self) -> int | None:
        """The server's peak resident set size so far (VmHWM), where /proc exists."""
        if self._process is None:
            return None
        try:
            with open(f"/proc/{self._process.pid}/status", encoding="ascii") as handle:
                for line in handle:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None

    def log_tail(self, lines: int = 15) -> str:
        if self._log is not None:
            self._log.flush()
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        process = self._process
        if process is not None and process.poll() is None:
            process.send_signal(signal.SIGINT)
            try:
                process.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
