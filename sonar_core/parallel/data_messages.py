"""What crosses between a data-parallel server and its replica processes: picklable commands,
replies, and each step's outputs as deltas.

A replica sends, per request and step, only what the step added (new token ids, logprobs and
inter-token gaps, the text after the part that stays), so the bytes pickled per step do not grow
with the output; the server keeps each request's cumulative output and rebuilds the
:class:`RequestOutput` the engine would have returned.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any

from sonar_core.errors import SonarError
from sonar_core.outputs import CompletionOutput, ListView, RequestMetrics, RequestOutput
from sonar_core.sampling_params import SamplingParams
from sonar_core.spec_decode.metrics import SpecDecodingStats


class ReplicaError(SonarError):
    """An engine replica stopped (or could not start) without an error of its own to report."""


# ------------------------------------------------------------------------------------- commands
@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival_time: float


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class Stop:
    """Finish the current step, close the engine and exit."""


Command = AddRequest | AbortRequest | Stop


# -------------------------------------------------------------------------------------- replies
@dataclass(frozen=True)
class ReplicaInfo:
    """Sent once, when the replica's engine is ready: what the server needs to know of the model.
    Only replica 0 sends its tokenizer (the server tokenizes with it)."""

    model_name: str
    max_model_len: int
    vocab_size: int
    num_speculative_tokens: int
    tokenizer: Any = None


@dataclass(frozen=True)
class ReplicaState:
    """A replica's engine state after its latest step; the counts are cumulative."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0
    num_kv_blocks: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    spec_stats: SpecDecodingStats | None = None


@dataclass(frozen=True)
class OutputDelta:
    """What one step added to one request's output."""

    request_id: str
    token_ids: list[int]
    logprobs: list[float] | None
    # The text is the first ``text_kept`` characters of the text sent before, then ``text``: it
    # only grows, except that a stop string completed at the end is cut off.
    text_kept: int
    text: str
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None
    error: str | None
    first_scheduled_time: float | None
    first_token_time: float | None
    last_token_time: float | None
    finished_time: float | None
    inter_token_latencies: list[float]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class StepReport:
    """After the replica applied commands or ran a step: the outputs, the requests it dropped
    (with why: refused, or in a step that failed) and its state."""

    deltas: list[OutputDelta]
    dropped: dict[str, str]
    state: ReplicaState


@dataclass(frozen=True)
class ReplicaFailed:
    """The engine could not start, or the replica's loop ended with an error; the process exits."""

    error: BaseException
    traceback: str


Reply = ReplicaInfo | StepReport | ReplicaFailed


def portable(error: BaseException) -> BaseException:
    """``error`` itself when it survives pickling (Sonar's errors do), else a ReplicaError with its
    type and message, so that the server can raise what the replica raised."""
    try:
        pickle.loads(pickle.dumps(error))
    except Exception:
        return ReplicaError(f"{type(error).__name__}: {error}")
    return error


# -------------------------------------------------------------------------------- replica side
@dataclass
class _Sent:
    num_tokens: int = 0
    num_chars: int = 0
    num_latencies: int = 0


class DeltaEncoder:
    """Turns the engine's cumulative outputs into deltas, remembering what each request sent."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def encode(self, output: RequestOutput) -> OutputDelta:
        sent = self._sent.setdefault(output.request_id, _Sent())
        completion = output.outputs[0]
        timing = output.metrics
        kept = min(sent.num_chars, len(completion.text))
        delta = OutputDelta(
            request_id=output.request_id,
            token_ids=completion.token_ids[sent.num_tokens :],
            logprobs=completion.logprobs[sent.num_tokens :] if completion.logprobs is not None else None,
            text_kept=kept,
            text=completion.text[kept:],
            cumulative_logprob=completion.cumulative_logprob,
            finish_reason=completion.finish_reason,
            stop_reason=completion.stop_reason,
            error=output.error,
            first_scheduled_time=timing.first_scheduled_time,
            first_token_time=timing.first_token_time,
            last_token_time=timing.last_token_time,
            finished_time=timing.finished_time,
            inter_token_latencies=timing.inter_token_latencies[sent.num_latencies :],
        )
        if output.finished:
            del self._sent[output.request_id]
        else:
            sent.num_tokens = len(completion.token_ids)
            sent.num_chars = len(completion.text)
            sent.num_latencies = len(timing.inter_token_latencies)
        return delta

    def forget(self, request_id: str) -> None:
        self._sent.pop(request_id, None)


# --------------------------------------------------------------------------------- server side
@dataclass
class _Assembly:
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    text: str = ""


class OutputAssembler:
    """Keeps each request's cumulative output and rebuilds its :class:`RequestOutput` per delta.

    As the engine's own outputs, a running request's token ids and logprobs are :class:`ListView`
    snapshots of lists that only grow, and the finished request's are plain lists; ``metrics`` is
    the request's live record.
    """

    def __init__(self) -> None:
        self._requests: dict[str, _Assembly] = {}

    def start(self, request_id: str, prompt: str | None, prompt_token_ids: list[int], arrival_time: float) -> None:
        self._requests[request_id] = _Assembly(prompt, prompt_token_ids, RequestMetrics(arrival_time=arrival_time))

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def apply(self, delta: OutputDelta) -> RequestOutput:
        request = self._requests[delta.request_id]
        request.token_ids.extend(delta.token_ids)
        if delta.logprobs is not None:
            request.logprobs.extend(delta.logprobs)
        before = len(request.text)
        request.text = request.text[: delta.text_kept] + delta.text
        timing = request.metrics
        timing.first_scheduled_time = delta.first_scheduled_time
        timing.first_token_time = delta.first_token_time
        timing.last_token_time = delta.last_token_time
        timing.finished_time = delta.finished_time
        timing.inter_token_latencies.extend(delta.inter_token_latencies)
        if delta.finished:
            del self._requests[delta.request_id]
            token_ids: list[int] | ListView[int] = list(request.token_ids)
            logprobs: list[float] | ListView[float] | None = list(request.logprobs)
        else:
            token_ids = ListView(request.token_ids, 0, len(request.token_ids))
            logprobs = ListView(request.logprobs, 0, len(request.logprobs))
        completion = CompletionOutput(
            index=0,
            text=request.text,
            token_ids=token_ids,
            cumulative_logprob=delta.cumulative_logprob,
            logprobs=logprobs if delta.logprobs is not None else None,  # None: the request asked for none
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
        )
        return RequestOutput(
            request_id=delta.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=delta.finished,
            metrics=timing,
            delta_text=request.text[before:],
            delta_token_ids=list(delta.token_ids),
            error=delta.error,
        )

    def fail(self, request_id: str, error: str) -> RequestOutput:
        """The last output of a request its replica dropped: finished (``abort``), with ``error``."""
        request = self._requests.pop(request_id)
        completion = CompletionOutput(
            index=0, text=request.text, token_ids=list(request.token_ids), cumulative_logprob=None, logprobs=None,
            finish_reason="abort",
        )
        return RequestOutput(
            request_id=request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=True,
            metrics=request.metrics,
            error=error,
        )
