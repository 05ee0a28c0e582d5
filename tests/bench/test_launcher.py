"""Workers in their own processes: progress, results, failures."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from bench_fakes import FAKE_WORKER

from sonar_core.bench.launcher import WorkerError, run_worker
from sonar_core.bench.peers.peer_protocol import BenchRequest, Job


def _job(method: str | None = None) -> Job:
    return Job(
        engine="fake", method=method, options={}, model_dir="/unused", gguf_path=None, dtype="float32",
        device="cpu", threads=1, max_tokens=4,
        requests=[BenchRequest("a", [1, 2, 3, 4, 5]), BenchRequest("b", [6, 7])],
        warmup_prompt_token_ids=[1], eos_token_ids=[0],
    )


def test_a_worker_reports_progress_and_its_result(tmp_path: Path) -> None:
    ticks: list[int] = []
    log = tmp_path / "worker.log"
    result = run_worker([sys.executable, str(FAKE_WORKER)], _job("echo"), on_progress=ticks.append, log_path=log)
    assert sum(ticks) == 2
    assert [r.token_ids for r in result.requests] == [[1, 2, 3, 4], [6, 7]]
    assert [n for _, n in result.requests[0].events] == [3, 1]
    assert result.spec is not None and result.spec.num_drafts == 3
    assert result.peak_rss_bytes and result.peak_rss_bytes > 0
    assert log.is_file()


def test_a_failing_worker_is_an_error_with_its_output(tmp_path: Path) -> None:
    script = tmp_path / "broken.py"
    script.write_text("import sys\nprint('something went wrong here')\nsys.exit(3)\n")
    with pytest.raises(WorkerError, match="status 3(.|\n)*something went wrong here"):
        run_worker([sys.executable, str(script)], _job())
