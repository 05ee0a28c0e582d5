"""llama-cpp-python as a benchmark peer: plain decoding, or prompt lookup
(``LlamaPromptLookupDecoding``).

Run as a script by the Python of ``.venv-llama``: ``python llama_cpp_worker.py JOB_JSON
RESULT_JSON`` (see ``peer_protocol``). It reads the target's GGUF file as shipped (for the
embedded SmolLM2, 4-bit Q4_1 weights), so its outputs are compared with Sonar's for agreement,
not expected to be identical. Greedy (``temp=0``), one request at a time, the KV cache reset
between requests.

llama.cpp's generator yields the tokens of one verification one by one; the worker hands them
on as one emission, at the moment the cycle ends (when the draft for the next cycle is asked
for), which is how the other engines report a step. llama-cpp-python keeps no acceptance
counters: the draft model is wrapped to record each draft's length, and the tokens a cycle
yields (accepted drafts plus one) give the accepted count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from peer_protocol import (
    BenchRequest,
    Job,
    RunResult,
    SpecCounts,
    current_rss_bytes,
    peak_rss_bytes,
    run_sequential,
    worker_main,
)

WARMUP_TOKENS = 16
CONTEXT_MARGIN = 64  # tokens of context beyond the longest prompt plus max_tokens


class CountingDraft:
    """Wraps a llama-cpp-python draft model: flushes the finished cycle's tokens as one
    emission and counts how many of the previous draft's tokens were accepted."""

    def __init__(self, draft: Any, depth: int) -> None:
        self.draft = draft
        self.counts = SpecCounts.empty(depth)
        self.flush: Callable[[], int] = lambda: 0
        self._pending = 0  # length of the draft under verification

    def __call__(self, input_ids: Any, /, **kwargs: Any) -> Any:
        yielded = self.flush()
        if self._pending:
            self.counts.observe(self._pending, yielded - 1)
        tokens = self.draft(input_ids, **kwargs)
        self._pending = len(tokens)
        return tokens

    def start_request(self) -> None:
        self._pending = 0  # a request that stopped mid-verification leaves no count


def run(job: Job) -> RunResult:
    import llama_cpp
    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    if job.gguf_path is None:
        raise SystemExit("llama-cpp-python needs the target as a GGUF file")
    if not job.options.get("extra_buffer_types", False):
        _disable_extra_buffer_types()
    counter = None
    if job.method == "prompt_lookup":
        depth = int(job.options.get("num_speculative_tokens", 4))
        lookup = LlamaPromptLookupDecoding(
            max_ngram_size=int(job.options.get("max_ngram_size", 2)), num_pred_tokens=depth
        )
        counter = CountingDraft(lookup, depth)
    elif job.method is not None:
        raise SystemExit(f"unknown llama-cpp-python mode {job.method!r}")
    longest = max(len(r.prompt_token_ids) for r in [*job.requests, BenchRequest("w", job.warmup_prompt_token_ids)])
    llm = Llama(
        model_path=job.gguf_path,
        n_ctx=longest + job.max_tokens + CONTEXT_MARGIN,
        n_threads=job.threads,
        n_threads_batch=job.threads,
        draft_model=counter,
        # llama-cpp-python 0.3.36 keeps logits of every position when it drafts, but sizes that
        # buffer from this argument: left False, any context past n_batch (512) overflows it.
        logits_all=counter is not None,
        seed=job.seed,
        verbose=False,
    )
    rss_after_load = current_rss_bytes()
    eos = set(job.eos_token_ids) | {llm.token_eos()}

    def generate(request: BenchRequest, emit: Callable[[list[int]], None], max_tokens: int = job.max_tokens) -> None:
        buffer: list[int] = []

        def flush() -> int:
            count = len(buffer)
            if buffer:
                emit(list(buffer))
                buffer.clear()
            return count

        if counter is not None:
            counter.flush = flush
            counter.start_request()
        produced = 0
        for token in llm.generate(request.prompt_token_ids, temp=0.0, top_k=1, top_p=1.0, min_p=0.0, reset=True):
            buffer.append(int(token))
            produced += 1
            if counter is None:
                flush()
            if token in eos or produced >= max_tokens:
                break
        flush()

    generate(BenchRequest("warmup", job.warmup_prompt_token_ids), lambda ids: None, WARMUP_TOKENS)
    if counter is not None:
        counter.counts = SpecCounts.empty(len(counter.counts.accepted_per_pos))
    records, started, finished = run_sequential(job.requests, generate)
    return RunResult(
        engine_version=f"llama-cpp-python {llama_cpp.__version__}",
        precision=f"GGUF {_file_type(llm)}",
        requests=records,
        started=started,
        finished=finished,
        peak_rss_bytes=peak_rss_bytes(),
        rss_after_load_bytes=rss_after_load,
        kv_cache_bytes=_kv_cache_bytes(llm),
        spec=counter.counts if counter is not None else None,
        notes=["weights as shipped in the GGUF file (quantized); KV cache f16, sized to the longest request"],
    )


def _disable_extra_buffer_types() -> None:
    """Make every model load with ``use_extra_bufts = False`` (``Llama`` has no argument for it)."""
    import llama_cpp.llama_cpp as bindings

    defaults = bindings.llama_model_default_params

    def without_extra_buffers() -> Any:
        params = defaults()
        params.use_extra_bufts = False
        return params

    bindings.llama_model_default_params = without_extra_buffers


# llama.cpp's LLAMA_FTYPE values of the common GGUF types.
_FILE_TYPES = {0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 7: "Q8_0", 8: "Q5_0", 9: "Q5_1", 15: "Q4_K_M", 17: "Q5_K_M", 18: "Q6_K", 32: "BF16"}


def _file_type(llm: Any) -> str:
    value = llm.metadata.get("general.file_type")
    return _FILE_TYPES.get(int(value), f"type {value}") if value is not None else "?"


def _kv_cache_bytes(llm: Any) -> int | None:
    """The f16 KV cache llama.cpp allocates: n_ctx positions of every layer's keys and values."""
    meta = llm.metadata
    arch = meta.get("general.architecture")
    try:
        layers = int(meta[f"{arch}.block_count"])
        heads = int(meta[f"{arch}.attention.head_count"])
        kv_heads = int(meta.get(f"{arch}.attention.head_count_kv", heads))
        head_dim = int(meta.get(f"{arch}.attention.key_length", int(meta[f"{arch}.embedding_length"]) // heads))
    except (KeyError, ValueError):
        return None
    return llm.n_ctx() * layers * 2 * kv_heads * head_dim * 2


if __name__ == "__main__":
    worker_main(run)
