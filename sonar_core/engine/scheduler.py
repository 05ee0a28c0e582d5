"""Continuous batching: which requests run this step, and how many tokens each."""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sonar_core.engine.block_manager import BlockManager, extend_block_hashes
from sonar_core.engine.sequence import Sequence, SequenceStatus
from sonar_core.spec_decode.proposer import DraftBranch


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
    # Draft branches verified beside the drafts, each as its own rows: the newest token again,
    # then the branch's drafts, in the branch's KV fork (only with every draft and one new token).
    draft_branches: list[DraftBranch] = field(default_factory=list)

    @property
    def num_query_tokens(self) -> int:
        """The request's rows in its own blocks."""
        return self.num_new_tokens + len(self.draft_token_ids)

    @property
    def num_rows(self) -> int:
        """Every row the step runs for the request, its branches' included."""
        return self.num_query_tokens + sum(1 + len(branch.token_ids) for branch in self.draft_branches)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_rows for s in self.scheduled)


class Scheduler:
    """FCFS continuous batching under a per-step token budget, with chunked prefill.

    Running requests go first (decodes and the rest of chunked prefills), then waiting ones join
    while the budget, ``max_num_seqs`` and free KV blocks allow. When blocks run out, the most
    recently arrived running request is preempted: its blocks are freed and it goes back to the
    front of the queue to be recomputed later. A request is never dropped.

    With prefix caching (``block_manager.enable_caching``) a waiting request joins with the cached
    blocks of its leading full blocks and starts computing after them (it always computes at least
    its newest token, so that the step samples); :meth:`cache_full_blocks` registers the blocks that a step's
    committed tokens filled. ``prefix_cache_queries`` counts the tokens of admitted requests and
    ``prefix_cache_hits`` those found cached (as vLLM's ``prefix_cache_queries`` / ``_hits``).
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
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

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
        seq.num_cached_blocks = 0

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
            budget -= item.num_rows
            index += 1
        if out.preempted:
            return out
        # Waiting requests join while there is room, starting after their cached prefix.
        manager = self.block_manager
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            cached = self._cached_prefix(seq)
            seq.num_computed_tokens = len(cached) * manager.block_size
            item = self._fit(seq, budget)
            if not manager.can_take(cached, seq.block_table, self._tokens_after(item)):
                seq.num_computed_tokens = 0
                break
            manager.take(seq.block_table, cached)
            if not manager.grow(seq.block_table, self._tokens_after(item)):
                raise AssertionError("the KV blocks counted free for a request were not there")
            seq.num_cached_blocks = len(cached)
            seq.num_cached_tokens = seq.num_computed_tokens
            if manager.enable_caching:
                self.prefix_cache_queries += seq.num_tokens
                self.prefix_cache_hits += seq.num_computed_tokens
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            out.scheduled.append(item)
            budget -= item.num_rows
        if manager.enable_caching:
            for item in out.scheduled:
                start = item.seq.num_computed_tokens
                manager.check_writable(item.seq.block_table, start, start + item.num_query_tokens)
        return out

    def _cached_prefix(self, seq: Sequence) -> list[int]:
        """The cached blocks a waiting request may start after: its leading full blocks, short of
        the block holding its newest token (which the step must compute to sample)."""
        manager = self.block_manager
        if not manager.enable_caching:
            return []
        if seq.block_table or seq.num_computed_tokens:
            raise AssertionError(f"waiting request {seq.request_id} holds KV blocks")
        # A block's hash covers the lookahead tokens after it, which must be known.
        num_full = (seq.num_tokens - max(1, manager.lookahead)) // manager.block_size
        self._hash_blocks(seq, num_full)
        return manager.cached_blocks(seq.block_hashes[:num_full])

    def _hash_blocks(self, seq: Sequence, num_blocks: int) -> None:
        """Make ``seq.block_hashes`` cover (at least) its first ``num_blocks`` full blocks."""
        block_size, lookahead = self.block_manager.block_size, self.block_manager.lookahead
        done = len(seq.block_hashes)
        if done < num_blocks:
            tokens = seq.token_slice(done * block_size, num_blocks * block_size + lookahead)
            extend_block_hashes(seq.block_hashes, tokens, block_size, lookahead)

    def cache_full_blocks(self, sched: SchedulerOutput) -> None:
        """After a step's requests were updated: register in the prefix cache every block that is
        now full of committed tokens (``num_computed_tokens`` after verification, and only tokens
        that are part of the request, so never a rejected draft's or a token past a stop), once the
        lookahead tokens after it are known too."""
        manager = self.block_manager
        if not manager.enable_caching:
            return
        block_size = manager.block_size
        for item in sched.scheduled:
            seq = item.seq
            if seq.is_finished:
                continue
            committed = min(seq.num_computed_tokens, seq.num_tokens - manager.lookahead)
            num_full = min(committed // block_size, len(seq.block_table))
            if num_full <= seq.num_cached_blocks:
                continue
            self._hash_blocks(seq, num_full)
            for index in range(seq.num_cached_blocks, num_full):
                manager.register(seq.block_table[index], seq.block_hashes[index])
            seq.num_cached_blocks = num_full

    @staticmethod
    def _tokens_after(item: ScheduledSequence) -> int:
        return item.seq.num_computed_tokens + item.num_query_tokens

    @staticmethod
    def _fit(seq: Sequence, budget: int) -> ScheduledSequence:
        """Take as many of the request's pending tokens as the budget allows; drafts come last, and
        draft branches only when all of them fit with every draft."""
        pending = seq.num_tokens - seq.num_computed_tokens
        num_new = min(pending, budget)
        reaches_end = num_new == pending
        drafts = seq.draft_token_ids[: budget - num_new] if reaches_end else []
        item = ScheduledSequence(seq=seq, num_new_tokens=num_new, draft_token_ids=drafts, samples=reaches_end)
        if seq.draft_branches and num_new == 1 and len(drafts) == len(seq.draft_token_ids):
            item.draft_branches = seq.draft_branches
            if item.num_rows > budget:
                item.draft_branches = []
        return item

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Free a running request's blocks and queue it first for recomputation."""
        self.running.remove(seq)
        self.block_manager.free(seq.block_table)
        seq.num_computed_tokens = 0
        seq.num_cached_blocks = 0
        seq.clear_drafts()
        seq.num_preemptions += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        out.preempted.append(seq)
        if self._on_preempt is not None:
            self._on_preempt(seq)
