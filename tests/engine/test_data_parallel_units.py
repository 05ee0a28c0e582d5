"""The in-process parts of data parallelism: outputs sent as deltas and rebuilt, the choice of a
replica, the thread split and each replica's configuration. (The processes themselves are tested
through a live server in tests/server/test_data_parallel.py.)"""

from __future__ import annotations

import logging
import multiprocessing
import pickle
import queue
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from sonar_core.config import EngineConfig
from sonar_core.parallel.data import (
    least_loaded,
    place_replicas,
    replica_config,
    replica_threads,
    visible_cuda_devices,
)
from sonar_core.parallel.data_messages import (
    AddRequest,
    DeltaEncoder,
    OutputAssembler,
    ReplicaError,
    Stop,
    portable,
)
from sonar_core.parallel.data_replica import Placement, ReplicaLoop
from sonar_core.sampling_params import SamplingParams
from sonar_core.spec_decode.metrics import SpecDecodingStats


def _comparable(output):
    completion = output.outputs[0]
    timing = output.metrics
    return (
        output.request_id, output.prompt, list(output.prompt_token_ids), output.finished, output.delta_text,
        list(output.delta_token_ids), output.error, completion.text, list(completion.token_ids),
        None if completion.logprobs is None else list(completion.logprobs), completion.cumulative_logprob,
        completion.finish_reason, completion.stop_reason, timing.arrival_time, timing.first_token_time,
        timing.last_token_time, timing.finished_time, list(timing.inter_token_latencies),
    )


def test_outputs_rebuilt_from_deltas_are_the_engines(make_llm):
    """Stop strings (the text cut back at the end), logprobs, several tokens per step (n-gram
    drafts) and requests of different lengths: every rebuilt output equals the engine's, and a
    running request's snapshot keeps its step's state."""
    engine = make_llm(
        max_model_len=128, speculative_config={"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    ).engine
    requests = {
        "plain": ([5, 6, 7, 5, 6, 7, 5, 6], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)),
        "logprobs": ([9, 10, 11], SamplingParams(temperature=0, max_tokens=12, logprobs=0, ignore_eos=True)),
    }
    for request_id, (prompt, params) in requests.items():
        engine.add_request(prompt, params, request_id, arrival_time=1.0)
    encoder, assembler = DeltaEncoder(), OutputAssembler()
    for request_id, (prompt, _) in requests.items():
        assembler.start(request_id, None, prompt, 1.0)
    snapshots = []
    while engine.has_unfinished_requests():
        for output in engine.step():
            rebuilt = assembler.apply(pickle.loads(pickle.dumps(encoder.encode(output))))
            assert _comparable(rebuilt) == _comparable(output)
            snapshots.append((rebuilt, _comparable(rebuilt)[:13]))
    assert all(_comparable(rebuilt)[:13] == then for rebuilt, then in snapshots)


def test_a_stop_string_cuts_text_already_sent():
    """The engine's text may shrink once, at the end (a completed stop string is cut off)."""
    from sonar_core.outputs import CompletionOutput, RequestMetrics, RequestOutput

    def output(text: str, token_ids: list[int], finish: str | None) -> RequestOutput:
        completion = CompletionOutput(0, text, token_ids, None, None, finish_reason=finish)
        return RequestOutput("r", None, [1], [completion], finish is not None, RequestMetrics(0.0))

    encoder, assembler = DeltaEncoder(), OutputAssembler()
    assembler.start("r", None, [1], 0.0)
    assert assembler.apply(encoder.encode(output("hello wor", [2, 3], None))).outputs[0].text == "hello wor"
    final = assembler.apply(encoder.encode(output("hello", [2, 3, 4], "stop")))
    assert (final.outputs[0].text, final.outputs[0].token_ids, final.delta_token_ids) == ("hello", [2, 3, 4], [4])


def test_a_dropped_request_ends_with_its_error():
    assembler = OutputAssembler()
    assembler.start("r", "hi", [1, 2], 0.0)
    failed = assembler.fail("r", "engine replica 1 stopped: killed by signal SIGKILL (pid 7)")
    assert failed.finished and failed.outputs[0].finish_reason == "abort"
    assert failed.error == "engine replica 1 stopped: killed by signal SIGKILL (pid 7)"


@pytest.mark.parametrize(
    ("loads", "start", "expected"),
    [
        ([0, 0], 0, 0),
        ([0, 0], 1, 1),
        ([2, 1, 1], 0, 1),
        ([2, 1, 1], 2, 2),
        ([1, 3, 0], 0, 2),
        ([None, 4, 2], 0, 2),
        ([None, None], 1, None),
    ],
)
def test_least_loaded_then_in_turn(loads, start, expected):
    assert least_loaded(loads, start) == expected


def test_equal_replicas_take_requests_in_turn():
    loads, start, chosen = [0, 0, 0], 0, []
    for _ in range(6):
        index = least_loaded(loads, start)
        chosen.append(index)
        loads[index] += 1
        start = (index + 1) % len(loads)
    assert chosen == [0, 1, 2, 0, 1, 2]


@pytest.mark.parametrize(
    ("cores", "start_threads", "replicas", "expected"),
    [(16, 16, 2, 8), (16, 16, 3, 5), (2, 2, 2, 1), (16, 4, 2, 4), (2, 2, 3, 1)],
)
def test_replicas_split_the_cores(monkeypatch, caplog, cores, start_threads, replicas, expected):
    monkeypatch.setattr(torch, "get_num_threads", lambda: start_threads)
    with caplog.at_level(logging.INFO, logger="sonar.parallel"):
        assert replica_threads(replicas, cores) == expected
    assert f"{replicas} replicas on {cores} cores, {expected} thread" in caplog.text
    assert ("more replicas than this machine has cores" in caplog.text) == (replicas > cores)


def test_cpu_replicas_of_one_rank_are_not_pinned_and_split_ones_get_their_share(monkeypatch):
    monkeypatch.setattr(torch, "get_num_threads", lambda: 8)
    plain = place_replicas(EngineConfig(device="cpu", data_parallel_size=2), range(8), [])
    assert plain == [Placement(4), Placement(4)]
    split = place_replicas(EngineConfig(device="cpu", data_parallel_size=2, tensor_parallel_size=2), range(8), [])
    assert [placement.cores for placement in split] == [(0, 1, 2, 3), (4, 5, 6, 7)]


def test_cuda_replicas_see_their_own_devices(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    one_rank = place_replicas(EngineConfig(device="cuda", data_parallel_size=2), range(16), ["0", "1", "2", "3"])
    assert [placement.cuda_devices for placement in one_rank] == [("0",), ("1",)]
    config = EngineConfig(data_parallel_size=2, tensor_parallel_size=2)
    split = place_replicas(config, range(16), ["4", "5", "6", "7"])
    assert [placement.cuda_devices for placement in split] == [("4", "5"), ("6", "7")]
    replica = replica_config(config)
    assert (replica.data_parallel_size, replica.tensor_parallel_size, replica.device) == (1, 2, "cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 1")
    assert visible_cuda_devices() == ["3", "1"]


def test_each_cpu_replica_is_one_engine_on_the_cpu():
    replica = replica_config(EngineConfig(device="cpu", data_parallel_size=2))
    assert (replica.data_parallel_size, replica.device) == (1, "cpu")


def test_errors_that_do_not_pickle_travel_as_their_text():
    class Local(Exception):
        def __init__(self, a, b):
            super().__init__(f"{a}/{b}")

    error = portable(Local(1, 2))
    assert isinstance(error, ReplicaError) and str(error) == "Local: 1/2"
    same = ValueError("bad")
    assert portable(same) is same


class _FailingEngine:
    """Holds requests and fails every step; ``problem`` is what it says of its own health."""

    def __init__(self, problem: str | None) -> None:
        self.problem = problem
        self.requests: set[str] = set()
        self.num_running = self.num_waiting = self.prefix_cache_queries = self.prefix_cache_hits = 0
        self.block_manager = SimpleNamespace(num_blocks=8)
        self.spec_stats = SpecDecodingStats(0)

    def add_request(self, prompt, params, request_id, arrival_time):
        self.requests.add(request_id)

    def abort_request(self, request_id):
        self.requests.discard(request_id)

    def has_unfinished_requests(self):
        return bool(self.requests)

    def step(self):
        raise RuntimeError("boom")

    def health_problem(self):
        return self.problem

    def kv_cache_usage(self):
        return 0.0


def _loop(engine: _FailingEngine) -> tuple[ReplicaLoop, queue.Queue, Any]:
    commands: queue.Queue = queue.Queue()
    replies, writer = multiprocessing.Pipe(duplex=False)
    return ReplicaLoop(engine, commands, writer), commands, replies


def test_a_failed_step_drops_its_requests_and_the_replica_serves_on():
    loop, commands, replies = _loop(_FailingEngine(problem=None))
    runner = threading.Thread(target=loop.run)
    runner.start()
    commands.put(AddRequest("r", [1, 2], SamplingParams(), 0.0))
    assert replies.poll(10)
    assert replies.recv().dropped == {"r": "the engine failed while generating this request: boom"}
    commands.put(Stop())
    runner.join(10)
    assert not runner.is_alive()


def test_an_engine_that_cannot_step_again_stops_its_replica():
    loop, commands, _ = _loop(_FailingEngine(problem="tensor-parallel rank 1 failed: killed"))
    commands.put(AddRequest("r", [1], SamplingParams(), 0.0))
    with pytest.raises(ReplicaError, match="tensor-parallel rank 1 failed: killed"):
        loop.run()
