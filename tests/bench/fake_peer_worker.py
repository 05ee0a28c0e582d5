"""A deterministic stand-in peer for the benchmark tests: it "generates" the prompt's own tokens.

Plain mode emits one token per step; the ``echo`` mode emits three per step and reports acceptance
counts, like a speculative peer. Run like every worker: ``fake_peer_worker.py JOB RESULT``.
"""

from __future__ import annotations

import time

from sonar_core.bench.peers.peer_protocol import (
    BenchRequest,
    Job,
    RunResult,
    SpecCounts,
    current_rss_bytes,
    peak_rss_bytes,
    run_sequential,
    worker_main,
)


def run(job: Job) -> RunResult:
    step = 3 if job.method == "echo" else 1
    steps = 0

    def generate(request: BenchRequest, emit) -> None:
        nonlocal steps
        tokens = request.prompt_token_ids[: job.max_tokens]
        for start in range(0, len(tokens), step):
            time.sleep(0.001)
            emit(tokens[start : start + step])
            steps += 1

    records, started, finished = run_sequential(job.requests, generate)
    spec = SpecCounts(steps, 2 * steps, 2 * steps, [steps, steps]) if job.method == "echo" else None
    return RunResult(
        engine_version="fake-peer 1.0",
        precision=job.dtype,
        requests=records,
        started=started,
        finished=finished,
        peak_rss_bytes=peak_rss_bytes(),
        rss_after_load_bytes=current_rss_bytes(),
        kv_cache_bytes=None,
        spec=spec,
        notes=["a stand-in"],
    )


if __name__ == "__main__":
    worker_main(run)
