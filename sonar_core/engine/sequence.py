"""A request's state inside the engine."""

from __future__ import annotations

import enum
import math
import sys
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

from sonar_core.engine.detokenizer import IncrementalDetokenizer
from sonar_core.outputs import ListView, RequestMetrics
from sonar_core.sampling_params import SamplingParams
from sonar_core.spec_decode.proposer import DraftBranch

# sum() of floats compensates its rounding errors from Python 3.12 (Neumaier's algorithm).
_COMPENSATED_SUM = sys.version_info >= (3, 12)


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class OutputTokenIds(ListView[int]):
    """A request's output tokens: the part of its token list after the prompt, read and appended
    in place. Output tokens are only ever appended, so snapshots of it stay true."""

    __slots__ = ()

    def __init__(self, token_ids: list[int], num_prompt_tokens: int) -> None:
        super().__init__(token_ids, num_prompt_tokens)

    def append(self, token_id: int) -> None:
        self._data.append(token_id)

    def extend(self, token_ids: Iterable[int]) -> None:
        self._data.extend(token_ids)

    def snapshot(self) -> ListView[int]:
        """The output tokens as they are now, without copying them."""
        return ListView(self._data, self._start, len(self._data))


class _RunningSum:
    """``sum(values)`` of a list that grows, brought up to date over the new values only: the
    float the built-in ``sum`` returns, on every Python version."""

    __slots__ = ("_values", "_total", "_compensation", "_count")

    def __init__(self) -> None:
        self._values: list[float] | None = None
        self._total = 0.0
        self._compensation = 0.0
        self._count = 0

    def of(self, values: list[float]) -> float:
        if values is not self._values or len(values) < self._count:  # another list: start over
            self.__init__()
            self._values = values
        total, compensation = self._total, self._compensation
        for i in range(self._count, len(values)):
            x = values[i]
            t = total + x
            if _COMPENSATED_SUM:
                compensation += (total - t) + x if abs(total) >= abs(x) else (x - t) + total
            total = t
        self._total, self._compensation, self._count = total, compensation, len(values)
        if compensation and math.isfinite(compensation):
            return total + compensation
        return total


@dataclass
class Sequence:
    """One request: its tokens, KV blocks, pending drafts and output bookkeeping.

    ``num_computed_tokens`` counts the leading tokens whose KV entries in the target's cache are
    valid. After a verify step it stops right after the last accepted draft, so the KV entries of
    rejected drafts are simply overwritten by the next step: that is the rollback.

    Its tokens live in one list that grows, prompt first: :attr:`all_token_ids` is that list
    itself, :attr:`output_token_ids` a view of its tail that appends to it, and neither copies.
    Tokens are only appended (never changed or removed); ``prompt_token_ids`` is never modified.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    eos_token_ids: frozenset[int]
    # Logprob of each output token when the request asked for logprobs (appended only).
    output_logprobs: list[float] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    # Drafts proposed after the previous step, to be verified in the next one.
    draft_token_ids: list[int] = field(default_factory=list)
    # [len(draft_token_ids), vocab] draft probabilities, or None for one-hot drafts.
    draft_probs: torch.Tensor | None = None
    # Alternatives to the drafts, each in a KV fork (num_draft_branches > 1). Their blocks are the
    # engine's to free (Speculator.drop_branches), so clear_drafts leaves them.
    draft_branches: list[DraftBranch] = field(default_factory=list)
    # Tokens appended since the proposer last saw this request (it catches up over them).
    num_unproposed_tokens: int = 0
    finish_reason: str | None = None
    # Why the request failed although its tokens are complete (a proposer could not finish its work
    # for it, e.g. write its hidden-state export); None when it did not fail.
    error: str | None = None
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    # Prefix caching: the chained content hashes of the request's leading full blocks (computed
    # once, extended as it grows); how many leading blocks of block_table are immutable (taken from
    # the cache, or full of committed tokens and registered, unless another block already caches
    # that content); how many tokens its latest admission found cached.
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_blocks: int = 0
    num_cached_tokens: int = 0
    # The prompt then every output token; output_token_ids is the view of its tail.
    _token_ids: list[int] = field(init=False, repr=False)
    _output_token_ids: OutputTokenIds = field(init=False, repr=False)
    _logprob_sum: _RunningSum = field(init=False, repr=False, default_factory=_RunningSum)

    def __post_init__(self) -> None:
        self._set_tokens(list(self.prompt_token_ids))

    def _set_tokens(self, token_ids: list[int]) -> None:
        self._token_ids = token_ids
        self._output_token_ids = OutputTokenIds(token_ids, len(self.prompt_token_ids))

    @property
    def num_tokens(self) -> int:
        return len(self._token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        """The prompt then every output token: the request's own list (read it, do not modify it;
        append outputs through :attr:`output_token_ids`)."""
        return self._token_ids

    @property
    def output_token_ids(self) -> OutputTokenIds:
        """The output tokens, a view of :attr:`all_token_ids` past the prompt (``append`` and
        ``extend`` add outputs)."""
        return self._output_token_ids

    @output_token_ids.setter
    def output_token_ids(self, token_ids: Iterable[int]) -> None:
        # A new list, so that snapshots of the old outputs keep showing them.
        self._set_tokens(self.prompt_token_ids + list(token_ids))

    def output_logprobs_snapshot(self) -> ListView[float]:
        """The output logprobs as they are now, without copying them."""
        return ListView(self.output_logprobs, 0, len(self.output_logprobs))

    @property
    def cumulative_logprob(self) -> float:
        """``sum(output_logprobs)``, computed over the logprobs added since the last call only."""
        return self._logprob_sum.of(self.output_logprobs)

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]``."""
        return self._token_ids[start:end]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def clear_drafts(self) -> None:
        self.draft_token_ids = []
        self.draft_probs = None
