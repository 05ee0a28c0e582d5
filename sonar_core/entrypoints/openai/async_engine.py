"""One engine shared by every HTTP request: a background thread steps it, asyncio code talks to it.

The engine is not thread-safe, so exactly one thread touches it. HTTP handlers never call it:
they put commands (add, abort, stop) on a queue and wake the thread, which applies them between
steps, so a request that arrives mid-step joins the running batch at the next one (continuous
batching across HTTP requests). Each step's outputs go back to the event loop through
``loop.call_soon_threadsafe`` into the request's own asyncio queue. PyTorch releases the GIL in
its kernels, so the event loop keeps serving while a step runs.

Failure isolation: a command that fails fails only its request; a step that raises fails the
requests the engine held at that moment (a step is one batch, and the engine state of its
requests is no longer trustworthy) and the thread carries on with the next requests. Nothing a
request does can end the thread; only :meth:`AsyncEngine.stop` does.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Protocol

from sonar_core.engine.request_errors import RequestError
from sonar_core.entrypoints.openai.metrics import EngineState, StatsRecorder
from sonar_core.outputs import RequestOutput
from sonar_core.sampling_params import SamplingParams

logger = logging.getLogger("sonar.server")

# How long stop() waits for the engine thread to finish its current step.
STOP_JOIN_TIMEOUT_S = 60.0


class Engine(Protocol):
    """The part of :class:`sonar_core.engine.llm_engine.LLMEngine` the server drives."""

    def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
    ) -> str: ...

    def step(self) -> list[RequestOutput]: ...

    def abort_request(self, request_id: str) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    @property
    def num_running(self) -> int: ...

    @property
    def num_waiting(self) -> int: ...

    def kv_cache_usage(self) -> float: ...


class EngineShutdownError(RuntimeError):
    """The server is shutting down; the request was aborted or never started (HTTP 503)."""


class EngineStepError(RuntimeError):
    """An engine step failed while this request was in the batch (HTTP 500)."""


class RequestFailedError(EngineStepError):
    """This request alone failed at its end (HTTP 500); the engine and other requests go on."""


class _Sink:
    """Carries one request's outputs (or the error that ended it) into its event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        """Called on the engine thread; raises RuntimeError when the event loop is closed."""
        self._loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float
    sink: _Sink
    accepted: concurrent.futures.Future[None]


@dataclass
class _Abort:
    request_id: str


class _Stop:
    """End the engine thread after aborting every request in flight."""


class RequestStream:
    """The outputs of one request, as an async iterator; :meth:`abort` ends it early.

    Iteration yields cumulative :class:`RequestOutput` objects and stops after the finished one;
    it raises :class:`EngineStepError` or :class:`EngineShutdownError` when the engine drops the
    request. Callers put :meth:`abort` in a ``finally`` block: it is a no-op once the request
    finished, and otherwise frees the request's KV blocks (client gone, handler cancelled).
    """

    def __init__(self, engine: AsyncEngine, request_id: str, sink: _Sink) -> None:
        self.request_id = request_id
        self._engine = engine
        self._sink = sink
        self._done = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._done:
            raise StopAsyncIteration
        item = await self._sink.queue.get()
        if isinstance(item, BaseException):
            self._done = True
            raise item
        self._done = item.finished
        return item

    def abort(self) -> None:
        if not self._done:
            self._done = True
            self._engine.abort(self.request_id)


class AsyncEngine:
    """Runs ``engine.step()`` on a background thread for as long as requests are in flight.

    ``recorder`` receives every step's outputs and the engine's state for the metrics and the
    periodic log. The thread sleeps on an event while the engine is idle (waking every log
    interval so the idle line is written when stats are logged).
    """

    def __init__(self, engine: Engine, recorder: StatsRecorder) -> None:
        self._engine = engine
        self._recorder = recorder
        self._commands: queue.SimpleQueue[_Add | _Abort | _Stop] = queue.SimpleQueue()
        self._wakeup = threading.Event()
        # Guards _closed together with the queue, so that nothing is queued after _Stop.
        self._submit_lock = threading.Lock()
        self._closed = False
        self._stopping = False
        self._sinks: dict[str, _Sink] = {}  # engine thread only
        self._thread = threading.Thread(target=self._run, name="sonar-engine", daemon=True)

    # ------------------------------------------------------------------------- event-loop side
    def start(self) -> None:
        self._thread.start()

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._closed

    async def add_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> RequestStream:
        """Queue a request and wait until the engine accepted it.

        Raises :class:`RequestError` (the request cannot be served as given, HTTP 400) or
        :class:`EngineShutdownError`. Cancelling the wait withdraws the request.
        """
        sink = _Sink(asyncio.get_running_loop())
        accepted: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._submit(_Add(request_id, prompt, params, time.monotonic(), sink, accepted))
        try:
            await asyncio.wrap_future(accepted)
        except asyncio.CancelledError:
            self.abort(request_id)
            raise
        return RequestStream(self, request_id, sink)

    def abort(self, request_id: str) -> None:
        """Withdraw a request (unknown or finished ids are ignored); its KV blocks are freed."""
        try:
            self._submit(_Abort(request_id))
        except EngineShutdownError:
            pass  # stopping aborts every request anyway

    def stop(self) -> None:
        """Abort every request in flight, then end the engine thread (waits for the current step)."""
        with self._submit_lock:
            if self._closed:
                return
            self._closed = True
            self._commands.put(_Stop())
        self._wakeup.set()
        if self._thread.is_alive():
            self._thread.join(STOP_JOIN_TIMEOUT_S)
            if self._thread.is_alive():
                logger.warning("the engine thread did not stop within %.0f s", STOP_JOIN_TIMEOUT_S)

    def _submit(self, command: _Add | _Abort) -> None:
        with self._submit_lock:
            if self._closed:
                raise EngineShutdownError("the server is shutting down")
            self._commands.put(command)
        self._wakeup.set()

    # --------------------------------------------------------------------------- engine thread
    def _run(self) -> None:
        logger.debug("engine thread started")
        while not self._stopping:
            try:
                self._iterate()
            except Exception:  # never let the thread die; the failing part already cleaned up
                logger.exception("unexpected error in the engine loop")
        logger.debug("engine thread stopped")

    def _iterate(self) -> None:
        self._wakeup.clear()
        self._apply_commands()
        if self._stopping:
            return
        if self._engine.has_unfinished_requests():
            self._step()
        else:
            self._recorder.observe_engine(self._state())
            self._wakeup.wait(self._recorder.interval_s if self._recorder.log_stats else None)
        self._recorder.maybe_log(self._state())

    def _state(self) -> EngineState:
        return EngineState(
            num_running=self._engine.num_running,
            num_waiting=self._engine.num_waiting,
            kv_cache_usage=self._engine.kv_cache_usage(),
            # Engines without a prefix cache (test fakes) report none.
            prefix_cache_queries=getattr(self._engine, "prefix_cache_queries", 0),
            prefix_cache_hits=getattr(self._engine, "prefix_cache_hits", 0),
        )

    def _apply_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if isinstance(command, _Add):
                self._add(command)
            elif isinstance(command, _Abort):
                self._abort(command.request_id, None)
            else:
                self._shutdown()
                return

    def _add(self, command: _Add) -> None:
        if not command.accepted.set_running_or_notify_cancel():
            return  # the handler gave up (client gone) before the request reached the engine
        try:
            self._engine.add_request(command.prompt, command.params, command.request_id, command.arrival_time)
        except RequestError as exc:
            command.accepted.set_exception(exc)
            return
        except Exception as exc:
            logger.exception("adding request %s failed", command.request_id)
            command.accepted.set_exception(exc)
            return
        self._sinks[command.request_id] = command.sink
        command.accepted.set_result(None)

    def _abort(self, request_id: str, error: BaseException | None) -> None:
        """Drop a request from the engine; ``error`` (if any) is what its stream raises."""
        sink = self._sinks.pop(request_id, None)
        if sink is None:
            return
        try:
            self._engine.abort_request(request_id)
        except Exception:
            logger.exception("aborting request %s failed", request_id)
        self._recorder.observe_abort(request_id)
        if error is not None:
            self._deliver(sink, error)

    def _step(self) -> None:
        try:
            outputs = self._engine.step()
        except Exception as exc:
            logger.exception("engine step failed; failing the %d requests in flight", len(self._sinks))
            error = EngineStepError(f"the engine failed while generating this request: {exc}")
            for request_id in list(self._sinks):
                self._abort(request_id, error)
            return
        try:
            self._recorder.observe_outputs(outputs)
        except Exception:
            logger.exception("recording metrics failed")
        for output in outputs:
            sink = self._sinks.get(output.request_id)
            if sink is None:
                continue  # aborted by its client while the step ran
            if output.finished:
                del self._sinks[output.request_id]
            if output.error is not None:
                self._deliver(sink, RequestFailedError(f"this request failed: {output.error}"))
                continue
            if not self._deliver(sink, output) and not output.finished:
                self._abort(output.request_id, None)
        self._recorder.observe_engine(self._state())

    @staticmethod
    def _deliver(sink: _Sink, item: RequestOutput | BaseException) -> bool:
        try:
            sink.put(item)
        except RuntimeError:  # the request's event loop is closed: nobody is listening
            return False
        return True

    def _shutdown(self) -> None:
        self._stopping = True
        if self._sinks:
            logger.info("shutting down: aborting %d requests in flight", len(self._sinks))
        error = EngineShutdownError("the server shut down before this request finished")
        for request_id in list(self._sinks):
            self._abort(request_id, error)
        self._recorder.observe_engine(self._state())
