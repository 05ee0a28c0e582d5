"""The contract between the benchmark and the process that runs one row of it, and the timing
loop every row shares.

Each row (Sonar with one speculative configuration, or a peer engine in one mode) runs in a fresh
process, so that its peak memory is its own and no engine's threads or caches leak into the next.
Peers run in their own virtual environments, which do not have Sonar's dependencies: this module
uses the standard library only, and a peer's worker script imports it from its own folder.

The parent writes a job (JSON) and reads back a result (JSON); while the job runs, the worker
writes one line per finished request to the file descriptor named by ``SONAR_BENCH_PROGRESS_FD``,
which drives the progress bar. Every engine is timed the same way: a request's clock starts when
it is handed to the engine, and each emission of new tokens is an event ``(time, count)``;
latency figures are computed from these events by the parent, never by the engine.
"""

from __future__ import annotations

import json
import os
import random
import resource
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

PROGRESS_FD_ENV = "SONAR_BENCH_PROGRESS_FD"


@dataclass
class BenchRequest:
    """One prompt of a job, already tokenized with the target's tokenizer (chat template applied),
    so that every engine gets exactly the same tokens."""

    id: str
    prompt_token_ids: list[int]


@dataclass
class Job:
    """What one worker process runs.

    ``method`` is None for plain decoding; ``options`` holds the row's settings (for Sonar the
    speculative configuration, for a peer its own knobs such as the draft length).
    """

    engine: str
    method: str | None
    options: dict[str, Any]
    model_dir: str  # the target as a Hugging Face folder (safetensors)
    gguf_path: str | None  # the same target as GGUF, for engines that read only GGUF
    dtype: str  # "bfloat16" or "float32"
    device: str
    threads: int
    max_tokens: int
    requests: list[BenchRequest]
    warmup_prompt_token_ids: list[int]
    eos_token_ids: list[int]
    concurrency: int = 1
    request_rate: float = float("inf")  # requests per second; inf sends as fast as concurrency allows
    seed: int = 0
    engine_args: dict[str, Any] = field(default_factory=dict)  # Sonar's engine flags

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Job:
        data = dict(data)
        data["requests"] = [BenchRequest(**item) for item in data["requests"]]
        if data.get("request_rate") is None:
            data["request_rate"] = float("inf")
        return cls(**data)

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if data["request_rate"] == float("inf"):
            data["request_rate"] = None  # JSON has no infinity
        return data


@dataclass
class RequestRecord:
    """What one request did: when it was submitted, when its tokens came out, and which tokens."""

    id: str
    submitted: float
    events: list[tuple[float, int]] = field(default_factory=list)  # (perf_counter time, new tokens)
    token_ids: list[int] = field(default_factory=list)
    text: str | None = None  # filled where token ids are not available (HTTP)


@dataclass
class SpecCounts:
    """Acceptance counters over the measured requests, as the engine counted them: one draft is
    one request-step that verified at least one drafted token."""

    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: list[int]

    @classmethod
    def empty(cls, depth: int = 0) -> SpecCounts:
        return cls(0, 0, 0, [0] * depth)

    def observe(self, drafted: int, accepted: int) -> None:
        """Count one verification of ``drafted`` tokens of which the first ``accepted`` were kept
        (a step without a draft is not a draft)."""
        if drafted <= 0:
            return
        accepted = max(0, min(accepted, drafted))
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        self.accepted_per_pos = _padded(self.accepted_per_pos, drafted)
        for position in range(accepted):
            self.accepted_per_pos[position] += 1

    def add_per_position(self, counts: list[int]) -> None:
        """Add accepted counts by position (lists of different depths line up at position 0)."""
        width = max(len(counts), len(self.accepted_per_pos))
        self.accepted_per_pos = [a + b for a, b in zip(_padded(self.accepted_per_pos, width), _padded(counts, width), strict=True)]

    def minus(self, earlier: SpecCounts) -> SpecCounts:
        """The counts since ``earlier`` (the warm-up is not measured)."""
        width = max(len(self.accepted_per_pos), len(earlier.accepted_per_pos))
        return SpecCounts(
            num_drafts=self.num_drafts - earlier.num_drafts,
            num_draft_tokens=self.num_draft_tokens - earlier.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens - earlier.num_accepted_tokens,
            accepted_per_pos=[
                a - b
                for a, b in zip(_padded(self.accepted_per_pos, width), _padded(earlier.accepted_per_pos, width), strict=True)
            ],
        )


def _padded(values: list[int], width: int) -> list[int]:
    """``values`` with zeros appended up to ``width`` (never shortened)."""
    return values + [0] * (width - len(values))


@dataclass
class RunResult:
    """A worker's answer. Times are ``time.perf_counter()`` seconds of the worker process."""

    engine_version: str
    precision: str  # what the weights were computed in: "bfloat16", "float32", "GGUF Q4_1", ...
    requests: list[RequestRecord]
    started: float
    finished: float
    peak_rss_bytes: int | None
    rss_after_load_bytes: int | None
    kv_cache_bytes: int | None  # memory the engine holds for its KV cache, where it says
    spec: SpecCounts | None  # None: plain decoding, or an engine that does not count acceptance
    peak_device_bytes: int | None = None  # peak allocated accelerator memory (CUDA)
    notes: list[str] = field(default_factory=list)
    # Sonar only: seconds in the target's forward and in the proposer over the measured requests.
    target_seconds: float | None = None
    propose_seconds: float | None = None

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> RunResult:
        data = dict(data)
        data["requests"] = [
            RequestRecord(**{**item, "events": [tuple(event) for event in item["events"]]}) for item in data["requests"]
        ]
        data["spec"] = SpecCounts(**data["spec"]) if data.get("spec") else None
        return cls(**data)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


# ------------------------------------------------------------------------------------ job files
def read_job(path: str) -> Job:
    with open(path, encoding="utf-8") as handle:
        return Job.from_json(json.load(handle))


def write_result(path: str, result: RunResult) -> None:
    with open(path, "w", encoding="utf-8") as handle:
        json.dump(result.to_json(), handle)


def worker_main(run: Callable[[Job], RunResult]) -> None:
    """The entry point of every worker: ``worker.py JOB_JSON RESULT_JSON``."""
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} JOB_JSON RESULT_JSON")
    job = read_job(sys.argv[1])
    os.environ.setdefault("OMP_NUM_THREADS", str(job.threads))
    write_result(sys.argv[2], run(job))


def report_progress() -> None:
    """Tell the parent that one more request finished (a no-op when it does not listen)."""
    fd = os.environ.get(PROGRESS_FD_ENV)
    if fd:
        try:
            os.write(int(fd), b"1\n")
        except OSError:
            pass  # the parent went away; the result file still tells the story


# ---------------------------------------------------------------------------------------- memory
def peak_rss_bytes() -> int:
    """The process's peak resident set size so far (ru_maxrss is KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def current_rss_bytes() -> int | None:
    """Resident set size now, from /proc (None where there is no /proc)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as handle:
            resident_pages = int(handle.read().split()[1])
    except OSError:
        return None
    return resident_pages * os.sysconf("SC_PAGE_SIZE")


# ---------------------------------------------------------------------------------------- timing
def arrival_offsets(count: int, rate: float, seed: int) -> list[float]:
    """When each request becomes due, in seconds after the start: all at once for an infinite
    rate, else a Poisson process of that rate (exponential gaps from a seeded generator, so a
    rerun replays the same arrivals)."""
    if rate == float("inf"):
        return [0.0] * count
    rng = random.Random(seed)
    offsets, now = [], 0.0
    for _ in range(count):
        offsets.append(now)
        now += rng.expovariate(rate)
    return offsets


@dataclass
class StepOutput:
    """New tokens of one request after one engine step."""

    request_id: str
    new_token_ids: list[int]
    finished: bool


def drive_step_engine(
    requests: list[BenchRequest],
    submit: Callable[[BenchRequest], None],
    step: Callable[[], Iterable[StepOutput]],
    concurrency: int,
    request_rate: float,
    seed: int,
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[RequestRecord], float, float]:
    """Run ``requests`` through an engine with an add-request/step interface (Sonar, vLLM).

    At most ``concurrency`` requests are in flight; each becomes due at its arrival offset and
    is submitted when due and a slot is free (its clock starts then). Returns the records (in
    request order), and the start and end times of the run.
    """
    due = deque(zip(requests, arrival_offsets(len(requests), request_rate, seed), strict=True))
    records = {request.id: RequestRecord(id=request.id, submitted=0.0) for request in requests}
    in_flight: set[str] = set()
    started = clock()
    while due or in_flight:
        now = clock()
        while due and len(in_flight) < concurrency and started + due[0][1] <= now:
            request, _ = due.popleft()
            records[request.id].submitted = clock()
            submit(request)
            in_flight.add(request.id)
        if not in_flight:
            time.sleep(max(0.0, started + due[0][1] - clock()))
            continue
        outputs = list(step())
        now = clock()
        for output in outputs:
            record = records[output.request_id]
            if output.new_token_ids:
                record.events.append((now, len(output.new_token_ids)))
                record.token_ids.extend(output.new_token_ids)
            if output.finished:
                in_flight.discard(output.request_id)
                report_progress()
    return [records[request.id] for request in requests], started, clock()


def run_sequential(
    requests: list[BenchRequest],
    generate: Callable[[BenchRequest, Callable[[list[int]], None]], None],
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[RequestRecord], float, float]:
    """Run ``requests`` one after another through an engine that serves one request at a time
    (transformers ``generate``, llama-cpp-python). ``generate(request, emit)`` calls ``emit`` with
    each batch of new token ids as the engine produces them."""
    records = []
    started = clock()
    for request in requests:
        record = RequestRecord(id=request.id, submitted=clock())

        def emit(token_ids: list[int], record: RequestRecord = record) -> None:
            if token_ids:
                record.events.append((clock(), len(token_ids)))
                record.token_ids.extend(token_ids)

        generate(request, emit)
        records.append(record)
        report_progress()
    return records, started, clock()


def run_static_batches(
    requests: list[BenchRequest],
    generate_batch: Callable[[list[BenchRequest], Callable[[list[list[int]]], None]], None],
    batch_size: int,
    eos_token_ids: list[int],
    clock: Callable[[], float] = time.perf_counter,
) -> tuple[list[RequestRecord], float, float]:
    """Run ``requests`` in batches of ``batch_size`` through an engine that decodes a whole padded
    batch at once and returns when its longest member ends (transformers ``generate`` on a list of
    prompts: static batching, the way that engine serves concurrent requests).

    Every request of a batch is submitted when the batch starts. ``generate_batch(batch, emit)``
    calls ``emit`` once per decoding step with each member's new token ids; a member's tokens after
    its first end-of-sequence token are padding and are not recorded.
    """
    records: list[RequestRecord] = []
    stops = set(eos_token_ids)
    started = clock()
    for first in range(0, len(requests), batch_size):
        batch = requests[first : first + batch_size]
        submitted = clock()
        members = [RequestRecord(id=request.id, submitted=submitted) for request in batch]
        done = [False] * len(batch)

        def emit(per_member: list[list[int]], members: list[RequestRecord] = members, done: list[bool] = done) -> None:
            now = clock()
            for index, token_ids in enumerate(per_member):
                if done[index] or not token_ids:
                    continue
                kept = []
                for token in token_ids:
                    kept.append(token)
                    if token in stops:
                        done[index] = True
                        report_progress()
                        break
                members[index].events.append((now, len(kept)))
                members[index].token_ids.extend(kept)

        generate_batch(batch, emit)
        for finished in done:
            if not finished:
                report_progress()
        records += members
    return records, started, clock()
