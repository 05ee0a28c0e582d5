"""What generation returns to callers, with vLLM's field names."""

from __future__ import annotations

import operator
from collections.abc import Iterator
from collections.abc import Sequence as SequenceABC
from dataclasses import dataclass, field
from typing import Any, TypeVar, overload

T = TypeVar("T")


class ListView(SequenceABC[T]):
    """``data[start:stop]`` of a list that only ever grows, read in place instead of copied.

    The output of a running request carries these for its token ids and logprobs, so that building
    it costs the same at the 4,000th token as at the first. A view made with a ``stop`` is fixed:
    what is appended to ``data`` later never shows through it (``stop=None`` follows the list's
    end instead). It behaves like a read-only list: indexing, slicing (which returns a list),
    ``len``, iteration, ``==`` with lists and other views, and ``+`` with lists (giving a list);
    ``list(view)`` makes a plain list, e.g. for ``json``.
    """

    __slots__ = ("_data", "_start", "_stop")

    def __init__(self, data: list[T], start: int = 0, stop: int | None = None) -> None:
        self._data = data
        self._start = start
        self._stop = stop

    def _end(self) -> int:
        return len(self._data) if self._stop is None else self._stop

    def __len__(self) -> int:
        return self._end() - self._start

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: int | slice) -> T | list[T]:
        offset = self._start
        if isinstance(index, slice):
            start, stop, step = index.indices(self._end() - offset)
            if step == 1:
                return self._data[offset + start : offset + stop]
            return [self._data[offset + i] for i in range(start, stop, step)]
        index = operator.index(index)
        length = self._end() - offset
        if index < 0:
            index += length
        if not 0 <= index < length:
            raise IndexError("list index out of range")
        return self._data[offset + index]

    def __iter__(self) -> Iterator[T]:
        return map(self._data.__getitem__, range(self._start, self._end()))

    def _items(self) -> list[T]:
        return self._data[self._start : self._end()]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ListView):
            other = other._items()
        elif not isinstance(other, list):
            return NotImplemented
        return self._items() == other

    __hash__ = None  # type: ignore[assignment]  # mutable-looking, like a list

    def __add__(self, other: list[T] | ListView[T]) -> list[T]:
        if not isinstance(other, (list, ListView)):
            return NotImplemented
        return self._items() + list(other)

    def __radd__(self, other: list[T]) -> list[T]:
        if not isinstance(other, list):
            return NotImplemented
        return other + self._items()

    def copy(self) -> list[T]:
        return self._items()

    def __repr__(self) -> str:
        return repr(self._items())

    def __reduce__(self) -> tuple[Any, ...]:
        return (ListView, (self._items(),))


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
    """One generated sequence of a request (Sonar generates n=1).

    ``token_ids`` and ``logprobs`` are plain lists in the output of a finished request. In the
    output of a running request they are :class:`ListView` objects over the engine's own lists: read-only,
    and fixed at that step (a later step never changes them).
    """

    index: int
    text: str
    token_ids: list[int] | ListView[int]
    cumulative_logprob: float | None
    # Logprob of each sampled token when SamplingParams.logprobs is set, else None.
    logprobs: list[float] | ListView[float] | None
    finish_reason: str | None = None  # "stop", "length", "abort" or None while running
    stop_reason: int | str | None = None  # the stop string or token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of a request after an engine step (cumulative, not a delta).

    Building it costs the step's new tokens, not the whole output: while the request runs, its
    completion's ``token_ids`` and ``logprobs`` are read-only :class:`ListView` snapshots of the
    engine's lists rather than copies (a snapshot never changes, so an output kept from an earlier
    step still shows that step's state); the finished request's output has plain lists. ``text``
    is always a ``str``; ``metrics`` is the request's live record, updated until it finishes.
    """

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
