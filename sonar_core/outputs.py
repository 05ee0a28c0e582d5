"""What generation returns to callers, with vLLM's field names."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RequestMetrics:
    """Timing of one request, in seconds of ``time.monotonic()``."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    # Gap between consecutive token emissions; a step that emits several tokens (accepted drafts)
    # contributes one gap, shared evenly by its tokens, as users perceive it in a stream.
    inter_token_latencies: list[float] = field(default_factory=list)

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One generated sequence of a request (Sonar generates n=1)."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    # Logprob of each sampled token when SamplingParams.logprobs is set, else None.
    logprobs: list[float] | None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of a request after an engine step (cumulative, not a delta)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # Text and token ids produced by the latest step only, for streaming.
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    # Set when the request failed at its end although its tokens are complete (its hidden-state
    # export could not be written): the server answers with an error instead of the output.
    error: str | None = None
