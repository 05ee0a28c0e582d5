"""One replica of a data-parallel server: a whole engine in a process of its own.

The process is spawned by :class:`~sonar_core.parallel.data.DataParallelEngine`. It receives
commands on a queue (adds, aborts, stop), steps its engine whenever it holds requests, and sends a
:class:`StepReport` down its pipe after every step (or batch of commands). It ignores SIGINT and
SIGTERM: a Ctrl+C or a service manager's SIGTERM reaches every process of the server, and the
server, not the signal, decides when a replica stops (after its graceful shutdown). A replica
whose server is gone exits by itself, so it is never left behind.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import torch

from sonar_core.config import EngineConfig
from sonar_core.engine.llm_engine import LLMEngine
from sonar_core.engine.request_errors import RequestError
from sonar_core.parallel.data_messages import (
    AbortRequest,
    AddRequest,
    Command,
    DeltaEncoder,
    OutputDelta,
    ReplicaError,
    ReplicaFailed,
    ReplicaInfo,
    ReplicaState,
    StepReport,
    Stop,
    portable,
)

logger = logging.getLogger("sonar.parallel")

# How often an idle replica (or, between steps, a busy one) looks whether its server still runs.
PARENT_CHECK_S = 1.0


@dataclass(frozen=True)
class Placement:
    """Where a replica runs (see :func:`sonar_core.parallel.data.place_replicas`): its torch
    threads and, when set, the CPU cores it and its tensor-parallel ranks are pinned to, or the
    CUDA devices they see. Ranks are child processes, so they inherit both."""

    threads: int
    cores: tuple[int, ...] | None = None
    cuda_devices: tuple[str, ...] | None = None

    def apply(self) -> None:
        """Before anything touches CUDA: the devices are read when CUDA starts."""
        if self.cuda_devices is not None:
            os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(self.cuda_devices)
        if self.cores is not None:
            os.sched_setaffinity(0, self.cores)
        torch.set_num_threads(self.threads)

    def describe(self) -> str:
        threads = f"{self.threads} thread{'' if self.threads == 1 else 's'}"
        if self.cuda_devices is not None:
            return f"CUDA devices {','.join(self.cuda_devices)}, {threads}"
        return f"cores {','.join(map(str, self.cores))}" if self.cores is not None else threads


@dataclass(frozen=True)
class LogSetup:
    """The server's logging, for the replica's own handler (a spawned process starts without one)."""

    level: int
    format: str | None
    datefmt: str | None

    @classmethod
    def of_this_process(cls) -> LogSetup:
        root = logging.getLogger()
        formatter = root.handlers[0].formatter if root.handlers else None
        return cls(
            level=logging.getLogger("sonar").getEffectiveLevel(),
            format=formatter._fmt if formatter is not None else None,
            datefmt=formatter.datefmt if formatter is not None else None,
        )

    def apply(self, index: int) -> None:
        """Log like the server, each message marked with the replica it comes from."""
        tag = f"[replica {index}] %(message)s"
        fmt = self.format.replace("%(message)s", tag) if self.format else f"%(levelname)s %(name)s: {tag}"
        # force: a spawned process runs the top level of the server's main script again, which
        # may have configured logging already.
        logging.basicConfig(level=self.level, format=fmt, datefmt=self.datefmt, force=True)


def run_replica(
    index: int, config: EngineConfig, placement: Placement, log_setup: LogSetup, commands: Any, replies: Connection
) -> None:
    """The replica process: start the engine, report it ready (or why it could not start), serve."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    log_setup.apply(index)
    placement.apply()
    logger.info("starting on %s: %s", config.resolved_device(), placement.describe())
    try:
        engine = LLMEngine(config)
    except BaseException as exc:  # every startup failure goes to the server, which reports it
        replies.send(ReplicaFailed(portable(exc), traceback.format_exc()))
        return
    try:
        replies.send(_info(engine, with_tokenizer=index == 0))
        ReplicaLoop(engine, commands, replies).run()
    except BaseException as exc:
        logger.exception("the replica stopped on an error")
        replies.send(ReplicaFailed(portable(exc), traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        engine.close()


def _info(engine: LLMEngine, with_tokenizer: bool) -> ReplicaInfo:
    return ReplicaInfo(
        model_name=engine.model_name,
        max_model_len=engine.max_model_len,
        vocab_size=engine.vocab_size,
        num_speculative_tokens=engine.spec_stats.num_speculative_tokens,
        tokenizer=engine.tokenizer if with_tokenizer else None,
    )


class ReplicaLoop:
    """Applies commands between steps and steps while the engine holds requests.

    Failure isolation is the single server's: a request the engine refuses, or the requests of a
    step that raises, are reported as dropped (with the reason) and the loop goes on, unless the
    engine reports that it cannot step again (a tensor-parallel rank died): then the loop raises
    and the replica stops, so that the server sends it nothing more.
    """

    def __init__(self, engine: LLMEngine, commands: Any, replies: Connection) -> None:
        self._engine = engine
        self._commands = commands
        self._replies = replies
        self._parent = multiprocessing.parent_process()
        self._encoder = DeltaEncoder()
        self._live: set[str] = set()
        self._dropped: dict[str, str] = {}
        self._running = True
        self._last_parent_check = time.monotonic()

    def run(self) -> None:
        while self._running:
            changed = self._apply(self._receive())
            if not self._running:
                return
            deltas: list[OutputDelta] = []
            if self._engine.has_unfinished_requests():
                deltas = self._step()
            elif not changed:
                continue
            self._report(deltas)

    def _receive(self) -> list[Command]:
        """The commands queued now; while the engine is idle, waits for the first one."""
        received: list[Command] = []
        if not self._engine.has_unfinished_requests():
            while self._running and not received:
                try:
                    received.append(self._commands.get(timeout=PARENT_CHECK_S))
                except queue.Empty:
                    self._check_parent()
        elif time.monotonic() - self._last_parent_check > PARENT_CHECK_S:
            self._check_parent()
        while True:
            try:
                received.append(self._commands.get_nowait())
            except queue.Empty:
                return received

    def _check_parent(self) -> None:
        self._last_parent_check = time.monotonic()
        if self._parent is not None and not self._parent.is_alive():
            logger.warning("the server process is gone; stopping")
            self._running = False

    def _apply(self, commands: list[Command]) -> bool:
        """Apply the commands; True when any changed what the engine holds."""
        for command in commands:
            if isinstance(command, AddRequest):
                try:
                    self._engine.add_request(
                        command.prompt_token_ids, command.params, command.request_id, command.arrival_time
                    )
                except RequestError as exc:
                    self._dropped[command.request_id] = str(exc)
                    continue
                self._live.add(command.request_id)
            elif isinstance(command, AbortRequest):
                self._engine.abort_request(command.request_id)
                self._live.discard(command.request_id)
                self._encoder.forget(command.request_id)
            elif isinstance(command, Stop):
                self._running = False
        return bool(commands)

    def _step(self) -> list[OutputDelta]:
        try:
            outputs = self._engine.step()
        except Exception as exc:
            problem = self._engine.health_problem()
            if problem is not None:  # the engine cannot step again: stop, so that no request comes here
                raise ReplicaError(problem) from exc
            logger.exception("engine step failed; failing the %d requests it held", len(self._live))
            reason = f"the engine failed while generating this request: {exc}"
            for request_id in self._live:
                self._engine.abort_request(request_id)
                self._encoder.forget(request_id)
                self._dropped[request_id] = reason
            self._live.clear()
            return []
        deltas = [self._encoder.encode(output) for output in outputs]
        for delta in deltas:
            if delta.finished:
                self._live.discard(delta.request_id)
        return deltas

    def _report(self, deltas: list[OutputDelta]) -> None:
        engine = self._engine
        state = ReplicaState(
            num_running=engine.num_running,
            num_waiting=engine.num_waiting,
            kv_cache_usage=engine.kv_cache_usage(),
            num_kv_blocks=engine.block_manager.num_blocks,
            prefix_cache_queries=engine.prefix_cache_queries,
            prefix_cache_hits=engine.prefix_cache_hits,
            spec_stats=engine.spec_stats.copy(),
        )
        self._replies.send(StepReport(deltas, self._dropped, state))
        self._dropped = {}
