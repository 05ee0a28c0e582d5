"""Hugging Face transformers as a benchmark peer: ``generate`` plain, with prompt lookup
(``prompt_lookup_num_tokens``) or with an assistant model (``assistant_model``).

Run as a script: ``python hf_worker.py JOB_JSON RESULT_JSON`` (see ``peer_protocol``). Greedy, on
the same token ids as every other row. Tokens are timed through a streamer, which ``generate``
calls once per step with every token the step accepted. At concurrency 1 requests run one at a
time; plain ``generate`` at a higher concurrency takes that many prompts at once, left-padded, and
decodes them as one static batch (transformers' assisted generation takes one prompt only).

transformers keeps no acceptance counters, so the worker counts them itself: it wraps the
candidate generator ``generate`` builds, recording each step's draft length (what
``get_candidates`` proposed) and accepted count (what ``update_candidate_strategy`` is told).
The assistant drafts a fixed number of tokens each step (the ``constant`` schedule, no
confidence cut-off), as Sonar's draft_model does, so that the two compare like for like.
"""

from __future__ import annotations

from typing import Any

from peer_protocol import (
    BenchRequest,
    Job,
    RunResult,
    SpecCounts,
    current_rss_bytes,
    peak_rss_bytes,
    run_sequential,
    run_static_batches,
    worker_main,
)

WARMUP_TOKENS = 16


class AcceptanceCounter:
    """Acceptance counts of assisted generation, gathered from its candidate generator."""

    def __init__(self, depth: int) -> None:
        self.counts = SpecCounts.empty(depth)
        self._drafted = 0

    def watch(self, generator: Any) -> Any:
        get_candidates = generator.get_candidates
        update = generator.update_candidate_strategy

        def counted_get_candidates(input_ids: Any, *args: Any, **kwargs: Any) -> Any:
            candidates = get_candidates(input_ids, *args, **kwargs)
            self._drafted = int(candidates[0].shape[1] - input_ids.shape[1])
            return candidates

        def counted_update(input_ids: Any, scores: Any, num_matches: Any) -> Any:
            # No draft this step (prompt lookup found no match) counts nothing.
            self.counts.observe(self._drafted, int(num_matches))
            return update(input_ids, scores, num_matches)

        generator.get_candidates = counted_get_candidates
        generator.update_candidate_strategy = counted_update
        return generator


def run(job: Job) -> RunResult:
    import torch
    import transformers
    from transformers import AutoModelForCausalLM
    from transformers.generation.streamers import BaseStreamer

    torch.set_num_threads(job.threads)
    dtype = getattr(torch, job.dtype)
    model = AutoModelForCausalLM.from_pretrained(job.model_dir, dtype=dtype).eval()
    depth = int(job.options.get("num_speculative_tokens", 0))
    kwargs: dict[str, Any] = {}
    if job.method == "prompt_lookup":
        kwargs["prompt_lookup_num_tokens"] = depth
        if "max_matching_ngram_size" in job.options:
            kwargs["max_matching_ngram_size"] = int(job.options["max_matching_ngram_size"])
    elif job.method == "assistant":
        assistant = AutoModelForCausalLM.from_pretrained(job.options["model"], dtype=dtype).eval()
        assistant.generation_config.num_assistant_tokens = depth
        assistant.generation_config.num_assistant_tokens_schedule = "constant"
        assistant.generation_config.assistant_confidence_threshold = 0.0
        kwargs["assistant_model"] = assistant
    elif job.method is not None:
        raise SystemExit(f"unknown transformers mode {job.method!r}")
    counter = AcceptanceCounter(depth) if job.method else None
    if counter is not None:
        make_generator = model._get_candidate_generator
        model._get_candidate_generator = lambda *a, **kw: counter.watch(make_generator(*a, **kw))
    rss_after_load = current_rss_bytes()

    pad_token_id = job.eos_token_ids[0]

    class Streamer(BaseStreamer):
        """Hands each step's new tokens, one list per batch member, to ``emit``; the first call
        carries the prompts."""

        def __init__(self, emit: Any) -> None:
            self.emit = emit
            self.prompt_seen = False

        def put(self, value: Any) -> None:
            if not self.prompt_seen:
                self.prompt_seen = True
                return
            self.emit(value.reshape(value.shape[0], -1).tolist() if value.dim() > 1 else [[t] for t in value.tolist()])

        def end(self) -> None:
            pass

    def generate_batch(batch: list[BenchRequest], emit: Any, max_tokens: int = job.max_tokens) -> None:
        width = max(len(request.prompt_token_ids) for request in batch)
        pads = [width - len(request.prompt_token_ids) for request in batch]  # left padding
        input_ids = torch.tensor([[pad_token_id] * pad + request.prompt_token_ids for pad, request in zip(pads, batch, strict=True)])
        attention_mask = torch.tensor([[0] * pad + [1] * (width - pad) for pad in pads])
        with torch.inference_mode():
            model.generate(
                input_ids,
                attention_mask=attention_mask,
                max_new_tokens=max_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                eos_token_id=job.eos_token_ids,
                pad_token_id=pad_token_id,
                streamer=Streamer(emit),
                **kwargs,
            )

    def generate(request: BenchRequest, emit: Any) -> None:
        generate_batch([request], lambda per_member: emit(per_member[0]))

    generate_batch([BenchRequest("warmup", job.warmup_prompt_token_ids)], lambda ids: None, WARMUP_TOKENS)
    if counter is not None:
        counter.counts = SpecCounts.empty(depth)
    notes = ["dynamic KV cache, grown per request"]
    if job.concurrency > 1:
        if job.method is not None:
            raise SystemExit(f"transformers {job.method} generates one request at a time")
        records, started, finished = run_static_batches(job.requests, generate_batch, job.concurrency, job.eos_token_ids)
        notes.append(f"static batches of {job.concurrency} left-padded prompts; a batch ends with its longest member")
    else:
        records, started, finished = run_sequential(job.requests, generate)
    return RunResult(
        engine_version=f"transformers {transformers.__version__}",
        precision=job.dtype,
        requests=records,
        started=started,
        finished=finished,
        peak_rss_bytes=peak_rss_bytes(),
        rss_after_load_bytes=rss_after_load,
        kv_cache_bytes=None,
        spec=counter.counts if counter is not None else None,
        notes=notes,
    )


if __name__ == "__main__":
    worker_main(run)
