"""Runs one row's worker in a process of its own and returns what it measured.

A process per row keeps each row's peak memory its own, lets a peer run in its own virtual
environment, and keeps one engine's threads and caches from slowing the next.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import tempfile
from collections.abc import Callable, Mapping
from pathlib import Path

from sonar_core.bench.peers.peer_protocol import PROGRESS_FD_ENV, Job, RunResult
from sonar_core.errors import SonarError

# Lines of a failed worker's log shown in the error.
LOG_TAIL_LINES = 25


class WorkerError(SonarError):
    """A worker process failed; the message carries the end of its log."""


def run_worker(
    command: list[str],
    job: Job,
    env: Mapping[str, str] | None = None,
    on_progress: Callable[[int], None] | None = None,
    log_path: Path | None = None,
) -> RunResult:
    """Run ``command JOB_JSON RESULT_JSON`` and return its result.

    ``on_progress(n)`` is called as the worker reports finished requests. The worker's output goes
    to ``log_path`` (kept) or to a temporary file (shown, in part, when the worker fails).
    """
    with tempfile.TemporaryDirectory(prefix="sonar-bench-") as tmp:
        job_path = Path(tmp) / "job.json"
        result_path = Path(tmp) / "result.json"
        job_path.write_text(json.dumps(job.to_json()), encoding="utf-8")
        log_file = log_path or Path(tmp) / "worker.log"
        read_fd, write_fd = os.pipe()
        child_env = {**(os.environ if env is None else env), PROGRESS_FD_ENV: str(write_fd)}
        try:
            with open(log_file, "wb") as log:
                process = subprocess.Popen(
                    [*command, str(job_path), str(result_path)],
                    env=child_env,
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    pass_fds=(write_fd,),
                )
                os.close(write_fd)
                write_fd = -1
                returncode = _wait(process, read_fd, on_progress)
        finally:
            if write_fd >= 0:
                os.close(write_fd)
            os.close(read_fd)
        if returncode != 0 or not result_path.is_file():
            tail = "\n".join(log_file.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:])
            raise WorkerError(f"{' '.join(command)} exited with status {returncode}; the end of its output:\n{tail}")
        return RunResult.from_json(json.loads(result_path.read_text(encoding="utf-8")))


def _wait(process: subprocess.Popen[bytes], read_fd: int, on_progress: Callable[[int], None] | None) -> int:
    """Wait for the process, passing its progress reports on. Polled rather than read to the end:
    a grandchild that inherited the pipe must not keep the benchmark waiting after the worker exits."""
    try:
        while process.poll() is None:
            _drain(read_fd, on_progress, timeout=0.2)
        _drain(read_fd, on_progress, timeout=0.0)
    except BaseException:
        process.kill()
        process.wait()
        raise
    return process.returncode


def _drain(read_fd: int, on_progress: Callable[[int], None] | None, timeout: float) -> None:
    while select.select([read_fd], [], [], timeout)[0]:
        chunk = os.read(read_fd, 4096)
        if not chunk:
            return
        if on_progress is not None:
            on_progress(chunk.count(b"\n"))
        timeout = 0.0


def sonar_command() -> list[str]:
    return [sys.executable, "-m", "sonar_core.bench.sonar_worker"]
