"""vLLM for CPU as a benchmark peer: plain decoding, or its ``ngram`` (prompt lookup) method.

Run as a script by the Python of ``.venv-vllm``: ``python vllm_worker.py JOB_JSON RESULT_JSON``
(see ``peer_protocol``). The engine core runs in this process
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), so that it is driven step by step like Sonar's (same
concurrency and arrivals) and its memory is this process's; Intel OpenMP is preloaded, as vLLM's
CPU installation guide asks. Acceptance counts are vLLM's own
``vllm:spec_decode_*`` counters, which count drafts the way Sonar does.
"""

from __future__ import annotations

import os
import sys
from typing import Any

from peer_protocol import (
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
KV_CACHE_GIB = "1"  # vLLM reserves this much KV cache on CPU unless VLLM_CPU_KVCACHE_SPACE says otherwise


def run(job: Job) -> RunResult:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", KV_CACHE_GIB)
    # vLLM pins its OpenMP threads to cores; on fewer threads than cores, pinning would keep them
    # on a core other work may hold, so the OS places them, as it does every other engine's.
    if job.threads < (os.cpu_count() or 1):
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import vllm
    from vllm import LLM, SamplingParams

    speculative_config = None
    if job.method == "ngram":
        speculative_config = {"method": "ngram", **job.options}
    elif job.method is not None:
        raise SystemExit(f"unknown vLLM mode {job.method!r}")
    llm = LLM(
        model=job.model_dir,
        dtype=job.dtype,
        max_num_seqs=job.concurrency,
        speculative_config=speculative_config,
        disable_log_stats=False,  # the acceptance counters are stats
        seed=job.seed,
    )
    engine = llm.llm_engine
    rss_after_load = current_rss_bytes()
    warmup = SamplingParams(temperature=0.0, max_tokens=WARMUP_TOKENS)
    llm.generate([{"prompt_token_ids": job.warmup_prompt_token_ids}], warmup, use_tqdm=False)
    before = _spec_counts(llm) if speculative_config else None
    params = SamplingParams(temperature=0.0, max_tokens=job.max_tokens, stop_token_ids=job.eos_token_ids)
    emitted: dict[str, int] = {}

    def submit(request: BenchRequest) -> None:
        emitted[request.id] = 0
        engine.add_request(request.id, {"prompt_token_ids": request.prompt_token_ids}, params)

    def step() -> list[StepOutput]:
        outputs = []
        for output in engine.step():
            token_ids = list(output.outputs[0].token_ids)  # cumulative
            new = token_ids[emitted[output.request_id] :]
            emitted[output.request_id] = len(token_ids)
            outputs.append(StepOutput(output.request_id, new, output.finished))
        return outputs

    records, started, finished = drive_step_engine(
        job.requests, submit, step, job.concurrency, job.request_rate, job.seed
    )
    spec = _spec_counts(llm).minus(before) if before is not None else None
    return RunResult(
        engine_version=f"vllm {vllm.__version__}",
        precision=job.dtype,
        requests=records,
        started=started,
        finished=finished,
        peak_rss_bytes=peak_rss_bytes(),
        rss_after_load_bytes=rss_after_load,
        kv_cache_bytes=_kv_cache_bytes(engine),
        spec=spec,
    )


def _spec_counts(llm: Any) -> SpecCounts:
    counts = SpecCounts.empty()
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name == "num_drafts":
            counts.num_drafts += int(metric.value)
        elif name == "num_draft_tokens":
            counts.num_draft_tokens += int(metric.value)
        elif name == "num_accepted_tokens":
            counts.num_accepted_tokens += int(metric.value)
        elif name == "num_accepted_tokens_per_pos":
            counts.add_per_position([int(v) for v in metric.values])
    return counts


def _kv_cache_bytes(engine: Any) -> int | None:
    """Blocks vLLM allocated times the bytes of one block across the model's layers."""
    config = engine.vllm_config
    blocks = config.cache_config.num_gpu_blocks
    if not blocks:
        return None
    model = config.model_config
    parallel = config.parallel_config
    per_token = 2 * model.get_num_layers(parallel) * model.get_num_kv_heads(parallel) * model.get_head_size() * model.dtype.itemsize
    return int(blocks * config.cache_config.block_size * per_token)


def preload_intel_openmp() -> None:
    """Restart this process with Intel OpenMP preloaded, as vLLM's CPU guide asks (without it,
    vLLM warns that speculative decoding loses much of its speed). The library comes with vLLM's
    ``intel-openmp`` dependency; where it is missing, nothing changes."""
    library = os.path.join(sys.prefix, "lib", "libiomp5.so")
    preload = os.environ.get("LD_PRELOAD", "")
    if os.path.isfile(library) and library not in preload.split(":"):
        os.environ["LD_PRELOAD"] = ":".join(filter(None, [library, preload]))
        os.execv(sys.executable, [sys.executable, *sys.argv])


if __name__ == "__main__":
    preload_intel_openmp()
    worker_main(run)
