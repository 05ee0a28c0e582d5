"""The worker contract and the shared timing loops, with fake engines and a fake clock."""

from __future__ import annotations

import json
import math

import pytest

from sonar_core.bench.peers.peer_protocol import (
    BenchRequest,
    Job,
    RequestRecord,
    RunResult,
    SpecCounts,
    StepOutput,
    arrival_offsets,
    drive_step_engine,
    run_sequential,
    run_static_batches,
)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FakeStepEngine:
    """Each step emits one token to every request in flight; a request finishes after ``length``."""

    def __init__(self, clock: FakeClock, length: int, step_seconds: float = 0.01) -> None:
        self.clock = clock
        self.length = length
        self.step_seconds = step_seconds
        self.in_flight: dict[str, int] = {}
        self.max_in_flight = 0

    def submit(self, request: BenchRequest) -> None:
        self.in_flight[request.id] = 0
        self.max_in_flight = max(self.max_in_flight, len(self.in_flight))

    def step(self) -> list[StepOutput]:
        self.clock.now += self.step_seconds
        outputs = []
        for request_id in list(self.in_flight):
            self.in_flight[request_id] += 1
            done = self.in_flight[request_id] == self.length
            outputs.append(StepOutput(request_id, [self.in_flight[request_id]], done))
            if done:
                del self.in_flight[request_id]
        return outputs


def _requests(count: int) -> list[BenchRequest]:
    return [BenchRequest(f"r{i}", [i, i + 1]) for i in range(count)]


@pytest.mark.parametrize("concurrency", [1, 2, 5])
def test_the_step_loop_keeps_the_concurrency(concurrency: int) -> None:
    clock = FakeClock()
    engine = FakeStepEngine(clock, length=4)
    records, started, finished = drive_step_engine(
        _requests(5), engine.submit, engine.step, concurrency, float("inf"), 0, clock
    )
    assert engine.max_in_flight == concurrency
    assert [r.id for r in records] == [f"r{i}" for i in range(5)]
    assert all(r.token_ids == [1, 2, 3, 4] for r in records)
    assert all(len(r.events) == 4 for r in records)
    steps = math.ceil(5 / concurrency) * 4
    assert finished - started == pytest.approx(steps * 0.01)


def test_a_request_clock_starts_when_it_is_submitted() -> None:
    clock = FakeClock()
    engine = FakeStepEngine(clock, length=2)
    records, _, _ = drive_step_engine(_requests(2), engine.submit, engine.step, 1, float("inf"), 0, clock)
    assert records[0].submitted == 0.0
    assert records[1].submitted == pytest.approx(0.02)  # waited for the first request's slot
    assert records[1].events[0][0] - records[1].submitted == pytest.approx(0.01)


def test_arrivals_are_a_seeded_poisson_process() -> None:
    assert arrival_offsets(3, float("inf"), 0) == [0.0, 0.0, 0.0]
    offsets = arrival_offsets(2000, 4.0, seed=7)
    assert offsets == arrival_offsets(2000, 4.0, seed=7)
    assert offsets != arrival_offsets(2000, 4.0, seed=8)
    assert offsets[0] == 0.0 and offsets == sorted(offsets)
    mean_gap = offsets[-1] / (len(offsets) - 1)
    assert mean_gap == pytest.approx(0.25, rel=0.1)


def test_the_step_loop_waits_for_arrivals() -> None:
    """With a finite rate the engine idles until the next request is due (real sleep, short)."""
    clock = FakeClock()
    engine = FakeStepEngine(clock, length=1, step_seconds=0.0)
    records, _, _ = drive_step_engine(_requests(3), engine.submit, engine.step, 3, 1000.0, 0, clock=_real_plus(clock))
    assert len(records) == 3 and all(r.token_ids == [1] for r in records)


def _real_plus(fake: FakeClock):
    import time

    start = time.perf_counter()
    return lambda: fake.now + time.perf_counter() - start


def test_sequential_runs_time_each_emission() -> None:
    clock = FakeClock()

    def generate(request: BenchRequest, emit) -> None:
        for token in request.prompt_token_ids:
            clock.now += 0.5
            emit([token])
        emit([])  # nothing new: not an event

    records, started, finished = run_sequential(_requests(2), generate, clock)
    assert records[0].events == [(0.5, 1), (1.0, 1)]
    assert records[1].submitted == 1.0
    assert (started, finished) == (0.0, 2.0)


def test_static_batches_submit_together_and_drop_padding_after_eos() -> None:
    clock = FakeClock()
    eos = 99
    # r0 ends with EOS after two tokens, then the batch pads it; r1 runs to the step limit; r2 is
    # alone in the second batch, submitted only when the first batch ended.
    script = {"r0": [[1], [eos], [eos], [eos]], "r1": [[5], [6], [7], [8]], "r2": [[eos]]}

    def generate_batch(batch: list[BenchRequest], emit) -> None:
        steps = len(script[batch[0].id])
        for step in range(steps):
            clock.now += 1.0
            emit([script[request.id][step] for request in batch])

    records, started, finished = run_static_batches(_requests(3), generate_batch, 2, [eos], clock)
    assert [r.token_ids for r in records] == [[1, eos], [5, 6, 7, 8], [eos]]
    assert records[0].events == [(1.0, 1), (2.0, 1)]
    assert records[0].submitted == records[1].submitted == 0.0
    assert records[2].submitted == 4.0 and records[2].events == [(5.0, 1)]
    assert (started, finished) == (0.0, 5.0)


def test_acceptance_counts_by_observation_and_by_position() -> None:
    counts = SpecCounts.empty(2)
    counts.observe(3, 2)  # a draft of 3, the first 2 accepted: the list grows to the draft's depth
    counts.observe(2, 5)  # more accepted than drafted is clamped
    counts.observe(0, 0)  # no draft: not counted
    assert counts == SpecCounts(2, 5, 4, [2, 2, 0])
    counts.add_per_position([1, 0, 0, 4])
    assert counts.accepted_per_pos == [3, 2, 0, 4]
    assert counts.minus(SpecCounts(1, 3, 2, [1, 1])) == SpecCounts(1, 2, 2, [2, 1, 0, 4])


def test_jobs_and_results_survive_json() -> None:
    job = Job(
        engine="sonar", method="ngram", options={"method": "ngram"}, model_dir="/m", gguf_path=None,
        dtype="float32", device="cpu", threads=1, max_tokens=8, requests=_requests(2),
        warmup_prompt_token_ids=[1], eos_token_ids=[2],
    )
    again = Job.from_json(json.loads(json.dumps(job.to_json())))
    assert again == job and again.request_rate == float("inf")
    result = RunResult(
        engine_version="x", precision="float32",
        requests=[RequestRecord("r0", 0.0, [(0.1, 2)], [5, 6])], started=0.0, finished=1.0,
        peak_rss_bytes=1, rss_after_load_bytes=1, kv_cache_bytes=None, spec=SpecCounts(1, 3, 2, [1, 1, 0]),
    )
    assert RunResult.from_json(json.loads(json.dumps(result.to_json()))) == result


def test_spec_counts_subtract_the_warmup() -> None:
    after = SpecCounts(10, 40, 25, [9, 8, 5, 3])
    before = SpecCounts(2, 8, 5, [2, 2, 1])
    assert after.minus(before) == SpecCounts(8, 32, 20, [7, 6, 4, 3])
