"""Runs one Sonar row of a benchmark in a process of its own.

``python -m sonar_core.bench.sonar_worker JOB_JSON RESULT_JSON`` (see
:mod:`sonar_core.bench.peers.peer_protocol`). The engine is driven step by step, so requests
arrive at the job's concurrency and rate exactly as the peers' do, and acceptance counts are read
from the engine before and after the measured requests, so the warm-up request is left out.
"""

from __future__ import annotations

from typing import Any

from sonar_core.bench.peers.peer_protocol import (
    BenchRequest,
    Job,
    RunResult,
    SpecCounts,
    StepOutput,
    current_rss_bytes,
    drive_step_engine,
    peak_rss_bytes,
    worker_main,
)

WARMUP_TOKENS = 16


def run(job: Job) -> RunResult:
    import torch

    from sonar_core import __version__
    from sonar_core.entrypoints.llm import LLM
    from sonar_core.sampling_params import SamplingParams

    torch.set_num_threads(job.threads)
    engine_args: dict[str, Any] = {
        "max_num_seqs": job.concurrency,
        **job.engine_args,
        "dtype": job.dtype,
        "device": job.device,
        "disable_log_stats": True,
    }
    llm = LLM(speculative_config=dict(job.options) if job.method else None, **engine_args)
    engine = llm.engine
    on_cuda = engine.device.type == "cuda"
    rss_after_load = current_rss_bytes()
    warmup = SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS)
    llm.generate([job.warmup_prompt_token_ids], warmup, use_tqdm=False)
    if on_cuda:
        torch.cuda.synchronize(engine.device)
        torch.cuda.reset_peak_memory_stats(engine.device)
    before = _spec_counts(llm) if job.method else None
    timing_before = (engine.timing.target_s, engine.timing.propose_s)
    params = SamplingParams(temperature=0.0, max_tokens=job.max_tokens)

    def submit(request: BenchRequest) -> None:
        engine.add_request(request.prompt_token_ids, params, request_id=request.id)

    def step() -> list[StepOutput]:
        return [StepOutput(out.request_id, list(out.delta_token_ids), out.finished) for out in engine.step()]

    records, started, finished = drive_step_engine(
        job.requests, submit, step, job.concurrency, job.request_rate, job.seed
    )
    spec = _spec_counts(llm).minus(before) if before is not None else None
    return RunResult(
        engine_version=f"sonar-core {__version__}",
        precision=str(engine.dtype).removeprefix("torch."),
        requests=records,
        started=started,
        finished=finished,
        peak_rss_bytes=peak_rss_bytes(),
        rss_after_load_bytes=rss_after_load,
        kv_cache_bytes=kv_cache_bytes(engine),
        spec=spec,
        peak_device_bytes=torch.cuda.max_memory_allocated(engine.device) if on_cuda else None,
        target_seconds=engine.timing.target_s - timing_before[0],
        propose_seconds=engine.timing.propose_s - timing_before[1] if job.method else None,
    )


def kv_cache_bytes(engine: Any) -> int:
    """Bytes of every KV cache tensor the engine allocated: the target's and the proposer's."""
    caches = list(engine.runner.kv_caches)
    if engine.speculator is not None:
        caches += list(engine.speculator.kv_caches)
    return sum(tensor.numel() * tensor.element_size() for pair in caches for tensor in pair)


def _spec_counts(llm: Any) -> SpecCounts:
    summary = llm.get_spec_decode_metrics()
    return SpecCounts(
        num_drafts=summary.num_drafts,
        num_draft_tokens=summary.num_draft_tokens,
        num_accepted_tokens=summary.num_accepted_tokens,
        accepted_per_pos=list(summary.num_accepted_tokens_per_pos),
    )


if __name__ == "__main__":
    worker_main(run)
