"""``--data-parallel-size 2``: two engine replicas behind one live server, on the tiny checkpoint.

Greedy outputs equal one engine's (with and without n-gram speculation), load reaches both
replicas, ``/metrics`` labels each replica's engine state and totals the rest, and failures stay
contained: a replica that cannot start fails the server as one engine would, a replica killed
mid-serving fails only its own requests, and SIGTERM leaves no process behind.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
from server_live import NGRAM_CONFIG, LiveServer, engine_kwargs, serve_in_thread
from test_server_run import ServerProcess

from sonar_core.config import EngineConfig
from sonar_core.entrypoints.openai.metrics import EngineState, ServerMetrics, StatsRecorder
from sonar_core.entrypoints.openai.server import run_server
from sonar_core.parallel.data import DataParallelEngine
from sonar_core.sampling_params import SamplingParams
from sonar_core.spec_decode.metrics import SpecDecodingStats

PROMPTS = [
    "The quick brown fox jumps",
    "one two three one two three one two three one",
    "def add(a, b):\n    return a + b\ndef add(a, b):\n",
    "Little robot loved",
    "Speculative decoding inference engine",
    "for i in range(10):\n",
    "River mountain city garden",
    "Count story began when",
]
MAX_TOKENS = 24
# The series of an engine's state: one per replica, labelled engine="0", engine="1".
ENGINE_SERIES = (
    "aphrodite:num_requests_running",
    "aphrodite:num_requests_waiting",
    "aphrodite:kv_cache_usage_perc",
    "aphrodite:prefix_cache_queries_total",
    "aphrodite:prefix_cache_hits_total",
)
# Short prompts and long outputs: still generating when a test looks at the replicas.
SHORT_PROMPTS = ["Little robot loved", "River mountain city garden", "Count story began when", "The quick brown fox"]
LONG = {"max_tokens": 100, "temperature": 0, "ignore_eos": True}


def dp_config(checkpoint: Path, **overrides: Any) -> EngineConfig:
    return EngineConfig(**{**engine_kwargs(checkpoint), "data_parallel_size": 2, **overrides})


def serve_replicas(config: EngineConfig) -> Iterator[LiveServer]:
    with DataParallelEngine(config) as engine, serve_in_thread(engine, served_model_name="tiny") as server:
        yield server


@pytest.fixture(scope="module")
def dp_live(checkpoint: Path) -> Iterator[LiveServer]:
    # Room for streams long enough to be seen running (test_requests_in_flight_are_spread_evenly).
    yield from serve_replicas(dp_config(checkpoint, max_model_len=1024))


@pytest.fixture(scope="module")
def dp_ngram(checkpoint: Path) -> Iterator[LiveServer]:
    yield from serve_replicas(dp_config(checkpoint, speculative_config=NGRAM_CONFIG))


@pytest.fixture(scope="module")
def expected(offline: Any) -> dict[str, Any]:
    """One engine's greedy completion per prompt."""
    outputs = offline.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return {prompt: output.outputs[0] for prompt, output in zip(PROMPTS, outputs, strict=True)}


def wait_idle(server: LiveServer, timeout: float = 30.0) -> None:
    """Until no replica holds a request and the gauges say so (they follow the last outputs a
    moment after those reach the clients)."""
    deadline = time.monotonic() + timeout
    while server.engine.has_unfinished_requests() or any(
        by_engine(server.metrics(), "aphrodite:num_requests_running").values()
    ):
        assert time.monotonic() < deadline, "the replicas still hold requests"
        time.sleep(0.02)


def by_engine(samples: dict, name: str) -> dict[str, float]:
    """The samples of series ``name`` by their engine label ('' for a sample without one)."""
    return {dict(labels).get("engine", ""): value for (series, labels), value in samples.items() if series == name}


async def complete_all(server: LiveServer, prompts: list[str]) -> list[str]:
    """Every prompt at once, half of them streamed."""

    async def one(client: Any, index: int, prompt: str) -> str:
        request = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
        if index % 2:
            stream = await client.completions.create(stream=True, **request)
            return "".join([chunk.choices[0].text async for chunk in stream if chunk.choices])
        return (await client.completions.create(**request)).choices[0].text

    async with server.async_client() as client:
        return await asyncio.gather(*(one(client, i, p) for i, p in enumerate(prompts)))


def start_streams(
    base_url: str, count: int, max_tokens: int = LONG["max_tokens"]
) -> tuple[list[threading.Thread], list[list[str]]]:
    """``count`` long streaming completions on threads; each one's ``data:`` payloads so far."""
    payloads: list[list[str]] = [[] for _ in range(count)]

    def stream(index: int) -> None:
        body = {"prompt": SHORT_PROMPTS[index % len(SHORT_PROMPTS)], "stream": True, **LONG, "max_tokens": max_tokens}
        with httpx.Client(base_url=base_url, timeout=60) as http:
            with http.stream("POST", "/v1/completions", json=body) as response:
                for line in response.iter_lines():
                    if line.startswith("data: "):
                        payloads[index].append(line.removeprefix("data: "))

    threads = [threading.Thread(target=stream, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    return threads, payloads


def observe_running(server: LiveServer, threads: list[threading.Thread], wanted: dict[str, float]) -> list[dict]:
    """The running gauges, read until they show ``wanted`` or the streams end."""
    seen: list[dict] = []
    while wanted not in seen and any(thread.is_alive() for thread in threads):
        seen.append(by_engine(server.metrics(), "aphrodite:num_requests_running"))
    return seen


# ---------------------------------------------------------------------------------- metrics
def test_replica_series_are_labelled_and_the_log_shows_the_totals(caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    replicas = [EngineState(1, 0, 0.25, 100, 40), EngineState(2, 1, 0.5, 50, 20)]
    metrics = ServerMetrics("m", 0, num_engines=2)
    recorder = StatsRecorder(
        metrics, SpecDecodingStats(0), log_stats=True, clock=lambda: now[0], replica_states=lambda: replicas
    )
    total = EngineState(3, 1, 0.375, 150, 60)
    recorder.observe_engine(total)
    text = metrics.render().decode()
    for line in (
        'aphrodite:num_requests_running{engine="0",model_name="m"} 1.0',
        'aphrodite:num_requests_running{engine="1",model_name="m"} 2.0',
        'aphrodite:kv_cache_usage_perc{engine="1",model_name="m"} 0.5',
        'aphrodite:prefix_cache_hits_total{engine="0",model_name="m"} 40.0',
        'aphrodite:prefix_cache_queries_total{engine="1",model_name="m"} 50.0',
    ):
        assert line in text
    assert 'aphrodite:num_requests_running{model_name="m"}' not in text
    now[0] = 6.0
    with caplog.at_level(logging.INFO, logger="sonar.server"):
        recorder.maybe_log(total)
    assert "Running: 3 reqs, Waiting: 1 reqs, KV cache usage: 37.5%, Prefix cache hit rate: 40.0%" in caplog.text


# ---------------------------------------------------------------------------------- serving
def test_concurrent_clients_get_one_engines_greedy_outputs_from_both_replicas(
    dp_live: LiveServer, expected: dict[str, Any]
) -> None:
    wait_idle(dp_live)
    before = dp_live.metrics()
    prompts = PROMPTS * 2
    texts = asyncio.run(complete_all(dp_live, prompts))
    assert texts == [expected[prompt].text for prompt in prompts]
    wait_idle(dp_live)
    after = dp_live.metrics()
    queries = {
        engine: value - by_engine(before, "aphrodite:prefix_cache_queries_total")[engine]
        for engine, value in by_engine(after, "aphrodite:prefix_cache_queries_total").items()
    }
    assert set(queries) == {"0", "1"} and all(tokens > 0 for tokens in queries.values()), queries
    prompt_tokens = by_engine(after, "aphrodite:prompt_tokens_total")[""] - by_engine(
        before, "aphrodite:prompt_tokens_total"
    )[""]
    assert sum(queries.values()) == prompt_tokens


def test_requests_in_flight_are_spread_evenly(dp_live: LiveServer) -> None:
    wait_idle(dp_live)
    # Long enough that a busy machine, where each metrics read is slow, still reads the gauges a few
    # times while all four run (100-token streams were once over after four reads).
    threads, payloads = start_streams(dp_live.base_url, 4, max_tokens=400)
    try:
        seen = observe_running(dp_live, threads, {"0": 2.0, "1": 2.0})
    finally:
        for thread in threads:
            thread.join(60)
    assert {"0": 2.0, "1": 2.0} in seen, seen
    assert all(payload[-1] == "[DONE]" for payload in payloads)


def test_each_replica_has_its_engine_series_and_the_rest_are_totals(
    dp_live: LiveServer, expected: dict[str, Any]
) -> None:
    wait_idle(dp_live)
    before = dp_live.metrics()
    asyncio.run(complete_all(dp_live, PROMPTS))
    wait_idle(dp_live)
    samples = dp_live.metrics()
    for name in ENGINE_SERIES:
        assert set(by_engine(samples, name)) == {"0", "1"}, name  # no unlabelled total beside them
    assert by_engine(samples, "aphrodite:num_requests_running") == {"0": 0.0, "1": 0.0}
    assert by_engine(samples, "aphrodite:kv_cache_usage_perc") == {"0": 0.0, "1": 0.0}
    generated = by_engine(samples, "aphrodite:generation_tokens_total")[""]
    assert generated - by_engine(before, "aphrodite:generation_tokens_total")[""] == sum(
        len(completion.token_ids) for completion in expected.values()
    )
    finished = [("aphrodite:request_success_total", (("finished_reason", reason),)) for reason in ("stop", "length")]
    assert sum(samples[key] - before[key] for key in finished) == len(PROMPTS)


def test_ngram_speculation_keeps_the_output_and_totals_the_replicas_counts(
    dp_ngram: LiveServer, expected: dict[str, Any]
) -> None:
    texts = asyncio.run(complete_all(dp_ngram, PROMPTS * 2))
    assert texts == [expected[prompt].text for prompt in PROMPTS * 2]
    wait_idle(dp_ngram)
    samples = dp_ngram.metrics()
    replicas = [state.spec_stats for state in dp_ngram.engine.replica_states()]
    assert all(stats.num_drafts > 0 for stats in replicas)  # both replicas speculated
    total = dp_ngram.engine.spec_stats
    assert total.num_drafts == sum(stats.num_drafts for stats in replicas)
    assert samples[("aphrodite:spec_decode_num_drafts_total", ())] == total.num_drafts
    assert samples[("aphrodite:spec_decode_num_draft_tokens_total", ())] == sum(s.num_draft_tokens for s in replicas)
    assert samples[("aphrodite:spec_decode_num_accepted_tokens_total", ())] == sum(
        s.num_accepted_tokens for s in replicas
    )
    for position in range(NGRAM_CONFIG["num_speculative_tokens"]):
        key = ("aphrodite:spec_decode_num_accepted_tokens_per_pos_total", (("position", str(position)),))
        assert samples[key] == sum(s.num_accepted_tokens_per_pos[position] for s in replicas)


# --------------------------------------------------------------------------------- failures
def test_a_replica_that_cannot_start_fails_the_server_as_one_engine_would(
    checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    broken = tmp_path / "no-weights"
    shutil.copytree(checkpoint, broken, ignore=shutil.ignore_patterns("*.safetensors"))
    args = SimpleNamespace(host="127.0.0.1", port=0, api_key=None, served_model_name=None)
    messages = []
    for size in (1, 2):
        code = run_server(EngineConfig(**{**engine_kwargs(broken), "data_parallel_size": size}), args)
        messages.append((code, capsys.readouterr().err.strip().splitlines()[-1]))
    assert messages[0] == messages[1]
    code, message = messages[1]
    assert code == 1 and message.startswith("aphrodite serve: error: cannot load the model: no weights in")


def test_a_replica_killed_mid_serving_fails_its_requests_and_the_other_serves_on(checkpoint: Path) -> None:
    # Streams of 1,000 tokens: long enough to be seen running on both replicas before the kill,
    # however fast the tiny model decodes.
    for server in serve_replicas(dp_config(checkpoint, max_model_len=1024)):
        engine = server.engine
        threads, payloads = start_streams(server.base_url, 4, max_tokens=1000)
        assert {"0": 2.0, "1": 2.0} in observe_running(server, threads, {"0": 2.0, "1": 2.0})
        os.kill(engine.replica_pids[1], signal.SIGKILL)  # while both of its requests generate
        for thread in threads:
            thread.join(60)
        assert not any(thread.is_alive() for thread in threads)
        last_events = [json.loads(payload[-2]) for payload in payloads]
        failed = [event["error"]["message"] for event in last_events if "error" in event]
        finished = [event for event in last_events if "choices" in event and event["choices"][0]["finish_reason"]]
        assert len(failed) == len(finished) == 2, last_events
        assert all(payload[-1] == "[DONE]" for payload in payloads)
        for message in failed:
            assert message.startswith("this request failed: engine replica 1 stopped: killed by signal SIGKILL")
        with server.http() as http:
            health = http.get("/health")
            assert health.status_code == 503 and "engine replica 1 stopped" in health.json()["error"]["message"]
            for prompt in PROMPTS[:3]:  # every new request goes to the replica that serves
                response = http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4})
                assert response.status_code == 200, response.text
        wait_idle(server)
        assert by_engine(server.metrics(), "aphrodite:num_requests_running") == {"0": 0.0, "1": 0.0}


def _descendants(pid: int) -> set[int]:
    """Every process below ``pid``, from ``ps``."""
    table = subprocess.run(["ps", "-e", "-o", "pid=,ppid="], capture_output=True, text=True, check=True).stdout
    children: dict[int, list[int]] = {}
    for line in table.splitlines():
        child, parent = map(int, line.split())
        children.setdefault(parent, []).append(child)
    found, todo = set(), [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.add(child)
            todo.append(child)
    return found


def _running(pids: set[int]) -> set[int]:
    alive = subprocess.run(["ps", "-o", "pid=", "-p", ",".join(map(str, pids))], capture_output=True, text=True)
    return {int(pid) for pid in alive.stdout.split()}


def test_sigterm_lets_streams_finish_and_leaves_no_process_behind(checkpoint: Path) -> None:
    server = ServerProcess({**engine_kwargs(checkpoint), "data_parallel_size": 2})
    try:
        threads, payloads = start_streams(f"http://127.0.0.1:{server.port()}", 2)
        deadline = time.monotonic() + 60
        while not all(payloads) and time.monotonic() < deadline:  # both streams in flight
            time.sleep(0.01)
        processes = _descendants(server.proc.pid)
        assert len(processes) >= 2  # the two replicas (and multiprocessing's resource tracker)
        server.proc.send_signal(signal.SIGTERM)
        for thread in threads:
            thread.join(60)
        assert server.wait() == 0, server.stderr
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    assert all(json.loads(p[-2])["choices"][0]["finish_reason"] == "length" for p in payloads)
    deadline = time.monotonic() + 10
    while _running(processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(processes)
    assert "Traceback" not in server.stderr


@pytest.mark.slow
def test_replicas_of_a_killed_server_exit_by_themselves(checkpoint: Path) -> None:
    server = ServerProcess({**engine_kwargs(checkpoint), "data_parallel_size": 2})
    try:
        server.port()
        processes = _descendants(server.proc.pid)
        server.proc.kill()
        server.wait()
    finally:
        if server.proc.poll() is None:
            server.proc.kill()
    deadline = time.monotonic() + 15
    while _running(processes) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _running(processes)


@pytest.mark.slow
def test_replicas_split_over_tensor_parallel_ranks_keep_to_their_cores(
    checkpoint: Path, expected: dict[str, Any]
) -> None:
    """Two replicas of two ranks each: every replica and its rank pinned to its own share of the
    cores, outputs still one engine's."""
    for server in serve_replicas(dp_config(checkpoint, tensor_parallel_size=2)):
        shares = []
        for pid in server.engine.replica_pids:
            ranks = _descendants(pid)
            assert ranks, "a replica of two ranks runs one worker process"
            shares.append({frozenset(os.sched_getaffinity(p)) for p in {pid, *ranks}})
        assert all(len(share) == 1 for share in shares) and shares[0] != shares[1], shares
        texts = asyncio.run(complete_all(server, PROMPTS[:4]))
        assert texts == [expected[prompt].text for prompt in PROMPTS[:4]]
