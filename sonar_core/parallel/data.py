"""Data parallelism: N engine replicas behind one server (``aphrodite serve --data-parallel-size N``).

:class:`DataParallelEngine` has the engine's interface (add_request, step, abort_request, ...), so
the server's engine thread drives it as it drives one engine. Each replica is a whole
:class:`~sonar_core.engine.llm_engine.LLMEngine` in a process of its own (``torch.multiprocessing``,
spawned), with its own weights, KV cache and, for suffix decoding, its own cache of earlier
responses. A request goes to the replica with the fewest requests in flight (ties in turn), and
stays there; its outputs come back as deltas (:mod:`~sonar_core.parallel.data_messages`).

On the CPU the replicas share the machine: each runs ``cores // N`` threads (at least one, at most
what one engine would start with), so that together they do not run more threads than cores. A
replica split over tensor-parallel ranks is pinned to its share of the cores instead, which its
ranks divide among them. On CUDA each replica sees only its own devices (``CUDA_VISIBLE_DEVICES``):
replica i the i-th group of ``tensor_parallel_size`` of them.

Failures stay where they happen. A replica that cannot start makes the whole server fail with
that replica's error (the one a single engine gives). A replica that dies while serving fails the
requests it held, with an error naming it and why it stopped; the others serve on, new requests
go to them, and ``/health`` reports the loss. Closing the engine (or the server process ending)
stops every replica.
"""

from __future__ import annotations

import atexit
import itertools
import logging
import os
import signal
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.multiprocessing

from sonar_core.config import EngineConfig
from sonar_core.engine.request_checks import check_request
from sonar_core.engine.request_errors import RequestError
from sonar_core.outputs import RequestOutput
from sonar_core.parallel.data_messages import (
    AbortRequest,
    AddRequest,
    OutputAssembler,
    ReplicaError,
    ReplicaFailed,
    ReplicaInfo,
    ReplicaState,
    Reply,
    StepReport,
    Stop,
)
from sonar_core.parallel.data_replica import LogSetup, Placement, run_replica
from sonar_core.sampling_params import SamplingParams
from sonar_core.spec_decode.metrics import SpecDecodingStats

logger = logging.getLogger("sonar.parallel")

# Longest a step waits for a replica's report when none is ready: short, because requests that
# arrive meanwhile reach the replicas only after the step returns.
POLL_S = 0.02
# How long close() lets each replica finish its step and exit before killing it.
STOP_TIMEOUT_S = 30.0


def cpu_cores() -> set[int]:
    """The cores this process may run on."""
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set(range(os.cpu_count() or 1))


def replica_threads(replicas: int, cores: int) -> int:
    """Threads of each CPU replica: the ``cores`` split evenly (at least one each), never more
    than one engine would start with (``OMP_NUM_THREADS``); logged, with a warning when the
    replicas outnumber the cores."""
    threads = max(1, min(torch.get_num_threads(), cores // replicas))
    if replicas > cores:
        logger.warning(
            "data_parallel_size=%d runs more replicas than this machine has cores (%d): they take turns on "
            "the cores, and fewer replicas would serve more",
            replicas, cores,
        )
    logger.info("data parallelism: %d replicas on %d cores, %d thread%s each", replicas, cores, threads,
                "" if threads == 1 else "s")
    return threads


def least_loaded(loads: Sequence[int | None], start: int) -> int | None:
    """The index of the smallest load (None: that replica does not serve); among equal loads the
    first at or after ``start``, cyclically, so that ties go round in turn. None when none serves."""
    candidates = [(load, (index - start) % len(loads), index) for index, load in enumerate(loads) if load is not None]
    return min(candidates)[2] if candidates else None


def place_replicas(config: EngineConfig, cores: Sequence[int], cuda_devices: Sequence[str]) -> list[Placement]:
    """Where each replica runs, given the cores this process may use and the visible CUDA devices:
    on CUDA the replica's own group of ``tensor_parallel_size`` devices; on the CPU, split over
    ranks, its own share of the cores (one engine's thread governor already keeps replicas of one
    rank within their share, and pinning them would make it count the other replicas' cores as
    its own, taken)."""
    replicas, ranks = config.data_parallel_size, config.tensor_parallel_size
    threads = replica_threads(replicas, len(cores))
    if config.resolved_device() == "cuda":
        return [Placement(threads, cuda_devices=tuple(cuda_devices[i * ranks : (i + 1) * ranks])) for i in range(replicas)]
    if ranks == 1:
        return [Placement(threads)] * replicas
    share = max(1, len(cores) // replicas)
    return [
        Placement(threads, cores=tuple(cores[(i * share + j) % len(cores)] for j in range(share)))
        for i in range(replicas)
    ]


def visible_cuda_devices() -> list[str]:
    """The CUDA devices this process may use, as ``CUDA_VISIBLE_DEVICES`` names them."""
    names = os.environ.get("CUDA_VISIBLE_DEVICES")
    if names is not None:
        return [name.strip() for name in names.split(",") if name.strip()]
    return [str(index) for index in range(torch.cuda.device_count())]


def replica_config(config: EngineConfig) -> EngineConfig:
    """The configuration of a replica: one engine, on the first of the devices it sees."""
    update: dict[str, Any] = {"data_parallel_size": 1}
    if config.resolved_device() == "cuda":
        update["device"] = "cuda"
    return config.model_copy(update=update)


class ReplicaTraceback(Exception):
    """Where a replica's error was raised: shown as the cause of the error the server re-raises
    (only a traceback that reaches the user shows it)."""


@dataclass
class _Replica:
    """The server's side of one replica process."""

    index: int
    process: Any
    commands: Any  # torch.multiprocessing Queue of Command
    replies: Connection
    requests: set[str] = field(default_factory=set)  # in flight here
    state: ReplicaState = field(default_factory=ReplicaState)
    stopped: str | None = None  # why it is no longer serving
    error: ReplicaFailed | None = None  # what it reported before it stopped

    @property
    def serving(self) -> bool:
        return self.stopped is None


class DataParallelEngine:
    """N :class:`LLMEngine` replicas in processes of their own, behind the engine interface.

    Not thread-safe, like the engine: one thread (the server's engine thread) calls it. Use it as
    a context manager, or call :meth:`close`; the replicas are also stopped at interpreter exit.
    """

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.num_replicas = config.data_parallel_size
        cuda = config.resolved_device() == "cuda"
        placements = place_replicas(config, sorted(cpu_cores()), visible_cuda_devices() if cuda else [])
        context = torch.multiprocessing.get_context("spawn")
        log_setup = LogSetup.of_this_process()
        self._replicas: list[_Replica] = []
        self._closed = False
        atexit.register(self.close)
        try:
            for index in range(self.num_replicas):
                commands = context.Queue()
                replies, writer = context.Pipe(duplex=False)
                process = context.Process(
                    target=run_replica,
                    args=(index, replica_config(config), placements[index], log_setup, commands, writer),
                    name=f"sonar-replica-{index}",
                )
                process.start()
                writer.close()  # the replica holds the only write end: its exit is an EOF here
                self._replicas.append(_Replica(index, process, commands, replies))
            info = self._wait_until_ready()
        except BaseException:
            self.close()
            raise
        self.tokenizer = info.tokenizer
        self.model_name = info.model_name
        self.max_model_len = info.max_model_len
        self.vocab_size = info.vocab_size
        self.spec_stats = SpecDecodingStats(info.num_speculative_tokens)
        self._assembler = OutputAssembler()
        self._owners: dict[str, _Replica] = {}
        self._pending: list[RequestOutput] = []  # failures to return at the next step
        self._next = 0  # where the round-robin among equally loaded replicas starts
        self._ids = itertools.count()
        logger.info("%d engine replicas ready", self.num_replicas)

    def _wait_until_ready(self) -> ReplicaInfo:
        """Replica 0's info once every replica is ready; the first startup failure raised as is."""
        infos: dict[int, ReplicaInfo] = {}
        waiting = {replica.replies: replica for replica in self._replicas}
        while waiting:
            for ready in wait(list(waiting)):
                replica = waiting.pop(ready)
                reply = self._receive_one(replica)
                if isinstance(reply, ReplicaInfo):
                    infos[replica.index] = reply
                    continue
                if isinstance(reply, ReplicaFailed):
                    raise reply.error from ReplicaTraceback(f"in engine replica {replica.index}:\n{reply.traceback}")
                raise ReplicaError(f"engine replica {replica.index} stopped while starting: {replica.stopped}")
        return infos[0]

    # ------------------------------------------------------------------------------ requests
    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str:
        """Route a request to the least loaded replica; raise :class:`RequestError` at once when it
        cannot be served as given (the checks of the engine itself)."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self._owners:
            raise RequestError(f"request id {request_id!r} is already in use")
        token_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        check_request(token_ids, params, vocab_size=self.vocab_size, max_model_len=self.max_model_len)
        arrival_time = arrival_time or time.monotonic()
        self._assembler.start(request_id, prompt if isinstance(prompt, str) else None, token_ids, arrival_time)
        replica = self._choose()
        if replica is None:
            self._pending.append(self._assembler.fail(request_id, self._no_replica_left()))
            return request_id
        replica.commands.put(AddRequest(request_id, token_ids, params, arrival_time))
        replica.requests.add(request_id)
        self._owners[request_id] = replica
        return request_id

    def _choose(self) -> _Replica | None:
        """The serving replica with the fewest requests in flight (None when none serves)."""
        index = least_loaded([len(r.requests) if r.serving else None for r in self._replicas], self._next)
        if index is None:
            return None
        self._next = (index + 1) % self.num_replicas
        return self._replicas[index]

    def abort_request(self, request_id: str) -> None:
        """Withdraw a request from its replica; unknown ids are ignored."""
        replica = self._owners.pop(request_id, None)
        if replica is None:
            return
        replica.requests.discard(request_id)
        self._assembler.forget(request_id)
        if replica.serving:
            replica.commands.put(AbortRequest(request_id))

    def has_unfinished_requests(self) -> bool:
        return bool(self._owners or self._pending)

    # ---------------------------------------------------------------------------------- step
    def step(self) -> list[RequestOutput]:
        """The outputs the replicas produced since the previous call: waits up to POLL_S for the
        first report when none is ready (the replicas step on their own, so this only gathers)."""
        outputs, self._pending = self._pending, []
        serving = {replica.replies: replica for replica in self._replicas if replica.serving}
        for ready in wait(list(serving), timeout=0 if outputs else POLL_S):
            replica = serving[ready]
            while replica.serving and replica.replies.poll():
                self._handle(replica, self._receive_one(replica), outputs)
        return outputs

    def _receive_one(self, replica: _Replica) -> Reply | None:
        """The replica's next reply; None (and the replica marked stopped) when it is gone."""
        try:
            reply: Reply = replica.replies.recv()
        except (EOFError, OSError, ValueError) as exc:  # ValueError and the like: a torn last message
            replica.stopped = self._exit_reason(replica, exc)
            return None
        if isinstance(reply, ReplicaFailed):
            replica.error = reply
        return reply

    def _handle(self, replica: _Replica, reply: Reply | None, outputs: list[RequestOutput]) -> None:
        if isinstance(reply, StepReport):
            self._follow(replica, reply.state)
            for delta in reply.deltas:
                if delta.request_id not in replica.requests:
                    continue  # aborted while the replica ran its step
                output = self._assembler.apply(delta)
                if output.finished:
                    self._release(replica, delta.request_id)
                outputs.append(output)
            for request_id, reason in reply.dropped.items():
                if request_id in replica.requests:
                    outputs.append(self._fail(replica, request_id, f"engine replica {replica.index}: {reason}"))
        elif reply is None:
            logger.error("engine replica %d stopped: %s; failing the %d requests it held", replica.index,
                         replica.stopped, len(replica.requests))
            reason = f"engine replica {replica.index} stopped: {replica.stopped}"
            for request_id in list(replica.requests):
                outputs.append(self._fail(replica, request_id, reason))

    def _follow(self, replica: _Replica, state: ReplicaState) -> None:
        """Take the replica's new state; its speculative-decoding counts join the total's."""
        if state.spec_stats is not None:
            before = replica.state.spec_stats or SpecDecodingStats(state.spec_stats.num_speculative_tokens)
            self.spec_stats.add(state.spec_stats.since(before))
        replica.state = state

    def _release(self, replica: _Replica, request_id: str) -> None:
        replica.requests.discard(request_id)
        del self._owners[request_id]

    def _fail(self, replica: _Replica, request_id: str, reason: str) -> RequestOutput:
        self._release(replica, request_id)
        return self._assembler.fail(request_id, reason)

    def _exit_reason(self, replica: _Replica, exc: BaseException) -> str:
        """Why a replica's connection ended, for the errors of its requests and the log."""
        process = replica.process
        process.join(1.0)
        if replica.error is not None:
            return f"{type(replica.error.error).__name__}: {replica.error.error}"
        code = process.exitcode
        if code is None:
            return f"its connection broke ({type(exc).__name__}: {exc}) (pid {process.pid})"
        if code < 0:
            return f"killed by signal {signal.Signals(-code).name} (pid {process.pid})"
        return f"exited with status {code} (pid {process.pid})"

    def _no_replica_left(self) -> str:
        stopped = "; ".join(f"replica {r.index}: {r.stopped}" for r in self._replicas)
        return f"no engine replica is running ({stopped}); restart the server"

    # ---------------------------------------------------------------------------- inspection
    def replica_states(self) -> list[ReplicaState]:
        """Each replica's engine state, for the per-replica metrics. A replica without requests
        has none running or waiting and no KV blocks held, whatever its last report said (it may
        predate the aborts of its last requests); the counts are cumulative."""
        return [
            replica.state if replica.requests else replace(replica.state, num_running=0, num_waiting=0,
                                                           kv_cache_usage=0.0)
            for replica in self._replicas
        ]

    @property
    def num_running(self) -> int:
        return sum(state.num_running for state in self.replica_states())

    @property
    def num_waiting(self) -> int:
        return sum(state.num_waiting for state in self.replica_states())

    def kv_cache_usage(self) -> float:
        """Fraction of all the replicas' KV blocks in use."""
        blocks = [replica.state.num_kv_blocks for replica in self._replicas]
        used = sum(n * state.kv_cache_usage for n, state in zip(blocks, self.replica_states(), strict=True))
        return used / sum(blocks) if sum(blocks) else 0.0

    @property
    def prefix_cache_queries(self) -> int:
        return sum(replica.state.prefix_cache_queries for replica in self._replicas)

    @property
    def prefix_cache_hits(self) -> int:
        return sum(replica.state.prefix_cache_hits for replica in self._replicas)

    def health_problem(self) -> str | None:
        """Why the server is not whole (a replica stopped), or None."""
        stopped = [f"engine replica {r.index} stopped: {r.stopped}" for r in self._replicas if not r.serving]
        return "; ".join(stopped) or None

    @property
    def replica_pids(self) -> list[int]:
        return [replica.process.pid for replica in self._replicas]

    # ----------------------------------------------------------------------------- lifecycle
    def close(self) -> None:
        """Stop every replica (idempotent): a stop command, then up to STOP_TIMEOUT_S for it to
        finish its step and exit, then SIGKILL."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        for replica in self._replicas:
            if replica.process.is_alive():
                replica.commands.put(Stop())
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for replica in self._replicas:
            while replica.process.is_alive() and time.monotonic() < deadline:
                # Read what it still sends, so that a replica blocked on a full pipe can exit.
                while replica.serving and replica.replies.poll(0.05):
                    self._receive_one(replica)
                replica.process.join(0.05)
            if replica.process.is_alive():
                logger.warning("engine replica %d did not stop within %.0f s; killing it", replica.index,
                               STOP_TIMEOUT_S)
                replica.process.kill()
                replica.process.join(5.0)
            replica.stopped = replica.stopped or "the server closed it"
            replica.commands.cancel_join_thread()  # never wait at exit to feed a replica that is gone
            replica.commands.close()
            replica.replies.close()

    def __enter__(self) -> DataParallelEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
