"""Continuous batching: which requests run this step, and how many tokens each."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sonar_core.engine.block_manager import BlockManager
from sonar_core.engine.sequence import Sequence, SequenceStatus


@dataclass
class ScheduledSequence:
    """One request's share of a step: tokens from ``num_computed_tokens`` on, then its drafts."""

    seq: Sequence
    # Known tokens (prompt/output) processed this step, starting at seq.num_computed_tokens.
    num_new_tokens: int
    # Drafts verified this step (appended after the known tokens; only when the chunk reaches the
    # newest token).
    draft_token_ids: list[int]
    # True when the chunk reaches the newest token, so the step samples for the request; False for
    # a chunk in the middle of a long prompt.
    samples: bool

    @property
    def num_query_tokens(self) -> int:
        return self.num_new_tokens + len(self.draft_token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_query_tokens for s in self.scheduled)


class Scheduler:
    """FCFS continuous batching under a per-step token budget, with chunked prefill.

    Running requests go first (decodes and the rest of chunked prefills), then waiting ones join
    while the budget, ``max_num_seqs`` and free KV blocks allow. When blocks run out, the most
    recently arrived running request is preempted: its blocks are freed and it goes back to the
    front of the queue to be recomputed later. A request is never dropped.
    """

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        on_preempt: Callable[[Sequence], None] | None = None,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self._on_preempt = on_preempt
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a finished or aborted request and free its blocks."""
        seq.status = SequenceStatus.FINISHED
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq.block_table)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        # Running requests, oldest first; preemption victims are taken from the end.
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            item = self._fit(seq, budget)
            while not self.block_manager.grow(seq.block_table, self._tokens_after(item)):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    item = None
                    break
            if item is None:
                break
            out.scheduled.append(item)
            budget -= item.num_query_tokens
            index += 1
        if out.preempted:
            return out
        # Waiting requests join while there is room.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            item = self._fit(seq, budget)
            if not self.block_manager.grow(seq.block_table, self._tokens_after(item)):
                break
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(item)
            budget -= item.num_query_tokens
        return out

    @staticmethod
    def _tokens_after(item: ScheduledSequence) -> int:
        return item.seq.num_computed_tokens + item.num_query_tokens

    @staticmethod
    def _fit(seq: Sequence, budget: int) -> ScheduledSequence:
        """Take as many of the request's pending tokens as the budget allows; drafts come last."""
        pending = seq.num_tokens - seq.num_computed_tokens
        num_new = min(pending, budget)
        reaches_end = num_new == pending
        drafts = seq.draft_token_ids[: budget - num_new] if reaches_end else []
        return ScheduledSequence(seq=seq, num_new_tokens=num_new, draft_token_ids=drafts, samples=reaches_end)

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free a running request's blocks and queue it first for recomputation."""
        self.running.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.clear_drafts()
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        if self._on_preempt is not None:
            self._on_preempt(seq)
