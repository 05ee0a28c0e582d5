"""Drives a proposer inside the engine: draft budgets, KV reservation, request lifecycle."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import torch

from sonar_core.attention_backends import AttentionBackend, get_backend
from sonar_core.engine.block_manager import BlockManager
from sonar_core.engine.kv_forks import KVForker
from sonar_core.engine.scheduler import ScheduledSequence
from sonar_core.engine.sequence import Sequence
from sonar_core.layers.linear import extra_rows_cost_little
from sonar_core.spec_decode.depth import AdaptiveDepth
from sonar_core.spec_decode.proposer import (
    DraftBranch,
    DraftProposal,
    KVFork,
    ProposalRequest,
    ProposeBatch,
    Proposer,
    ProposerRequestError,
    TargetHiddenStates,
)


@dataclass
class ProposeItem:
    """One request the target ran this step, as the proposer will see it."""

    seq: Sequence
    # Drafts the request may get (0 for a prefill chunk that did not reach the prompt's end).
    budget: int
    # Its valid rows of the step's flat batch, and the position of the first.
    hidden_rows: slice
    hidden_start: int
    partial_prefill: bool
    # The request ended this step (a stop or its length): these are its last rows.
    finished: bool = False


@dataclass
class _WholeDraft:
    """A free-drafts proposer's whole draft for a request, before auto depth cut it."""

    tokens: list[int]
    source: Hashable
    # Where the draft starts in the request's tokens.
    position: int


# Most target rows a step verifies with draft branches in it (the rows one pass of the CPU's
# matrix tiles takes at no extra cost on AMX: one request's three chains of four).
BRANCH_ROW_LIMIT = 16

# Chains per request where speculative_config.num_draft_branches is unset and branches pay.
AUTO_DRAFT_BRANCHES = 3


@dataclass(frozen=True)
class DraftBranching:
    """How many chains a drafting request gets per step (speculative_config.num_draft_branches),
    and whether only while it is the step's one drafting request.

    Unset, a request drafting alone gets AUTO_DRAFT_BRANCHES chains where extra verified rows cost
    little on the CPU (bfloat16 on AMX tiles): on the chat benchmark with the shipped EAGLE-3 head,
    one request at a time, three drafts went from 1.49-1.55x to 1.55-1.67x plain decoding, while at
    two concurrent requests branches measured no gain (docs/performance.md). Elsewhere one chain:
    on other CPUs every row costs its multiply-adds, and on accelerators branches are unmeasured."""

    count: int = 1
    only_alone: bool = False

    @classmethod
    def of(
        cls,
        configured: int | None,
        proposer_branches: bool,
        device: torch.device,
        dtype: torch.dtype,
        forkable: bool,
    ) -> DraftBranching:
        """``configured`` as given, or the unset default for a proposer that drafts branches
        (``proposer_branches``) over a target whose requests can fork their KV (``forkable``: one
        rank, no recurrent states) on ``device`` in ``dtype``."""
        if configured is not None:
            return cls(configured)
        if proposer_branches and forkable and device.type == "cpu" and extra_rows_cost_little(device, dtype):
            return cls(AUTO_DRAFT_BRANCHES, only_alone=True)
        return cls()


def _checked_branches(branches: list[DraftBranch], drafts: list[int], request: ProposalRequest) -> list[DraftBranch]:
    """A request's branches, after checking that each fits its fork (``max_branch_draft_tokens``)
    and its request's drafts, and that they can be told apart from its drafts at the first token
    (verification takes the chain whose first draft the target emits)."""
    if not branches:
        return []
    longest = min(len(drafts), request.max_branch_draft_tokens)
    if any(not 0 < len(branch.token_ids) <= longest for branch in branches):
        raise RuntimeError(
            f"request {request.request_id} got draft branches empty or longer than its own drafts or "
            f"than max_branch_draft_tokens ({request.max_branch_draft_tokens})"
        )
    firsts = [drafts[0]] + [branch.token_ids[0] for branch in branches]
    if len(set(firsts)) != len(firsts):
        raise RuntimeError(f"request {request.request_id}'s draft branches do not each start with a token of their own")
    return branches


def _drafting(items: list[ProposeItem]) -> list[int]:
    """Indices of the items that go on sampling next step (not mid-prefill, not finished)."""
    return [i for i, item in enumerate(items) if not item.partial_prefill and not item.finished]


class Speculator:
    """Asks the proposer for the next step's drafts and keeps it in step with each request.

    The engine calls :meth:`propose` after every step with the requests that sampled, and
    :meth:`release` when a request finishes, is aborted or preempted. Nothing here depends on which
    method the proposer implements; only its declared capabilities are read.
    """

    def __init__(
        self,
        proposer: Proposer,
        num_speculative_tokens: int,
        draft_max_model_len: int,
        block_manager: BlockManager,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
        device: torch.device,
        adaptive_depth: bool = False,
        attention_backend: AttentionBackend | None = None,
        target_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        branching: DraftBranching = DraftBranching(),
    ) -> None:
        self.proposer = proposer
        self.attention_backend = attention_backend or get_backend(None)
        self.capabilities = proposer.capabilities
        max_depth = self.capabilities.max_depth
        self.num_speculative_tokens = (
            num_speculative_tokens if max_depth is None else min(num_speculative_tokens, max_depth)
        )
        self.draft_max_model_len = draft_max_model_len
        self.block_manager = block_manager
        self.kv_caches = kv_caches
        # Handed to the proposer only when it declares that it reads them.
        self.target_kv_caches = target_kv_caches if self.capabilities.reads_target_kv else None
        self.device = device
        self.depth = AdaptiveDepth(self.num_speculative_tokens) if adaptive_depth else None
        self._known: set[str] = set()
        self._free_drafts: dict[str, _WholeDraft] = {}
        self.num_draft_branches = min(branching.count, self.capabilities.max_draft_branches)
        self.branches_only_alone = branching.only_alone
        # Forks the proposer made this step, per request, until its branches take them.
        self._forks: dict[str, list[KVFork]] = {}
        self.forker: KVForker | None = None
        if self.num_draft_branches > 1:
            if target_kv_caches is None:
                raise ValueError("draft branches need the target's KV caches, to fork them")
            self.forker = KVForker(block_manager, target_kv_caches + kv_caches)

    def draft_budget(self, seq: Sequence, max_model_len: int) -> int:
        """How many drafts a request may get this step.

        Never more than the configured depth; never past the target's or the draft's context limit
        (long requests stop speculating); never more than the tokens the request may still emit
        minus the bonus token, so no work is drafted that max_tokens would throw away.
        """
        budget = self.num_speculative_tokens
        budget = min(budget, max_model_len - seq.num_tokens - 1, self.draft_max_model_len - seq.num_tokens)
        if seq.params.max_tokens is not None:
            budget = min(budget, seq.params.max_tokens - len(seq.output_token_ids) - 1)
        return max(budget, 0)

    def reserve(self, seq: Sequence, budget: int) -> int:
        """Grow the request's blocks for ``budget`` drafts (and a block drafter's whole block);
        returns the budget that fits, 0 when the cache has no room now."""
        if budget == 0:
            return 0
        capabilities = self.capabilities
        ahead = max(budget, capabilities.draft_block_len - 1)
        needed = seq.num_tokens + ahead + capabilities.extra_slots_per_request
        return budget if self.block_manager.grow(seq.block_table, needed) else 0

    def propose(self, items: list[ProposeItem], hidden: TargetHiddenStates | None) -> None:
        """Set ``draft_token_ids`` (and ``draft_probs``) on every sampling request for the next step.

        ``items`` holds every request the target ran this step and that is still running, prefill
        chunks included (their budget is 0), so that proposers reading target states see every
        position once.
        """
        budgets = [item.budget for item in items]
        if self._cuts_free_drafts:
            self._observe_free_draft_outcomes(items)
        elif self.depth is not None:
            drafting = _drafting(items)
            chosen = self.depth.choose([items[i].seq.request_id for i in drafting], [budgets[i] for i in drafting])
            for i, budget in zip(drafting, chosen, strict=True):
                budgets[i] = budget
        requests: list[ProposalRequest] = []
        for item, budget in zip(items, budgets, strict=True):
            seq = item.seq
            if seq.request_id not in self._known:
                self.proposer.add_request(seq.request_id, seq.prompt_token_ids)
                self._known.add(seq.request_id)
                seq.num_unproposed_tokens = seq.num_tokens
            requests.append(
                ProposalRequest(
                    request_id=seq.request_id,
                    token_ids=seq.all_token_ids,
                    num_new_tokens=seq.num_unproposed_tokens,
                    max_draft_tokens=self.reserve(seq, budget),
                    block_table=seq.block_table,
                    hidden_rows=item.hidden_rows,
                    hidden_start=item.hidden_start,
                    is_partial_prefill=item.partial_prefill,
                    is_finished=item.finished,
                    params=seq.params,
                    generator=seq.generator,
                )
            )
            seq.num_unproposed_tokens = 0
        self._allot_branches(requests)
        batch = ProposeBatch(
            requests=requests,
            block_size=self.block_manager.block_size,
            kv_caches=self.kv_caches,
            device=self.device,
            target_hidden=hidden,
            target_kv_caches=self.target_kv_caches,
            fork=self._fork if self.forker is not None else None,
        )
        try:
            with self.attention_backend.active(self.device):
                proposal = self.proposer.propose(batch)
        except BaseException:
            for forks in self._forks.values():
                self._free_forks(forks)
            self._forks = {}
            raise
        made, self._forks = self._forks, {}
        drafts = proposal.token_ids
        for request, tokens in zip(requests, drafts, strict=True):
            if len(tokens) > request.max_draft_tokens:
                raise RuntimeError(
                    f"proposer {type(self.proposer).__name__} returned {len(tokens)} drafts for request "
                    f"{request.request_id}, more than its max_draft_tokens={request.max_draft_tokens}"
                )
        if self._cuts_free_drafts:
            drafts = self._cut_free_drafts(items, proposal)
        offset = 0
        for item, tokens in zip(items, drafts, strict=True):
            item.seq.draft_token_ids = list(tokens)
            if proposal.probs is not None:
                item.seq.draft_probs = proposal.probs[offset : offset + len(tokens)]
            offset += len(tokens)
        self._attach_branches(items, requests, proposal, made)

    def _allot_branches(self, requests: list[ProposalRequest]) -> None:
        """Give draft branches to drafting requests, in order, while the next step's verified rows
        (every drafting request's newest token and drafts, and the branches given) stay within
        BRANCH_ROW_LIMIT: a branch pays while its rows cost little more than the step already does,
        not once the step is large (several concurrent requests). With ``branches_only_alone``, only
        a request that drafts alone in its step gets them."""
        if self.num_draft_branches == 1:
            return
        drafting = [r for r in requests if r.max_draft_tokens > 0]
        if self.branches_only_alone and len(drafting) > 1:
            return
        rows = sum(1 + r.max_draft_tokens for r in drafting)
        for request in drafting:
            branch_rows = 1 + request.max_branch_draft_tokens
            extra = min(self.num_draft_branches - 1, max(BRANCH_ROW_LIMIT - rows, 0) // branch_rows)
            request.max_draft_branches = 1 + extra
            rows += extra * branch_rows

    def _fork(self, request: ProposalRequest, count: int) -> list[KVFork]:
        """ProposeBatch.fork: forks for the drafts after the request's newest token."""
        assert self.forker is not None
        count = min(count, request.max_draft_branches - 1)  # 0 unless _allot_branches gave some
        if count <= 0 or request.request_id in self._forks:
            return []
        position = len(request.token_ids) - 1
        forks = self.forker.fork(request.block_table, position, position + 1 + request.max_branch_draft_tokens, count)
        self._forks[request.request_id] = forks
        return forks

    def _attach_branches(
        self,
        items: list[ProposeItem],
        requests: list[ProposalRequest],
        proposal: DraftProposal,
        made: dict[str, list[KVFork]],
    ) -> None:
        """Give each request the branches drafted for it; free the forks no branch took."""
        for index, (item, request) in enumerate(zip(items, requests, strict=True)):
            forks = made.pop(request.request_id, [])
            branches = proposal.branches[index] if proposal.branches is not None else []
            taken = {id(branch.fork) for branch in branches}
            if not taken <= {id(fork) for fork in forks} or len(taken) != len(branches):
                raise RuntimeError(
                    f"proposer {type(self.proposer).__name__} returned a draft branch for request "
                    f"{request.request_id} in a fork it was not given for it"
                )
            item.seq.draft_branches = _checked_branches(branches, item.seq.draft_token_ids, request)
            self._free_forks([fork for fork in forks if id(fork) not in taken])
        for forks in made.values():
            self._free_forks(forks)

    def settle_branches(self, scheduled: list[ScheduledSequence], winners: list[int], num_accepted: list[int]) -> None:
        """After verification: make a winning branch's KV its request's own, then free the forks of
        every request that sampled (``winners`` and ``num_accepted`` as the verifier gives them)."""
        if self.forker is None:
            return
        for item, winner, accepted in zip(scheduled, winners, num_accepted, strict=True):
            if winner:
                # The newest token and the accepted drafts, in the fork's blocks.
                end = item.seq.num_computed_tokens + 1 + accepted
                self.forker.adopt(item.draft_branches[winner - 1].fork, item.seq.block_table, end)
            if item.samples:
                self.drop_branches(item.seq)

    def drop_branches(self, seq: Sequence) -> None:
        """Free the forks of a request's draft branches (after verification, or when it leaves)."""
        self._free_forks([branch.fork for branch in seq.draft_branches])
        seq.draft_branches = []

    def _free_forks(self, forks: list[KVFork]) -> None:
        if forks:
            assert self.forker is not None
            self.forker.free(forks)

    @property
    def _cuts_free_drafts(self) -> bool:
        """Auto depth with a proposer whose whole drafts cost nothing: draft, then cut."""
        return self.depth is not None and self.capabilities.free_drafts

    def _cut_free_drafts(self, items: list[ProposeItem], proposal: DraftProposal) -> list[list[int]]:
        """Each request's drafts cut to the depth that pays for their source; the whole drafts are
        kept until the next step shows how far the request's tokens followed them."""
        assert self.depth is not None
        if proposal.sources is None:
            raise RuntimeError(
                f"proposer {type(self.proposer).__name__} declares free_drafts but returned no sources"
            )
        drafts = list(proposal.token_ids)
        drafting = _drafting(items)
        chosen = self.depth.choose(
            [items[i].seq.request_id for i in drafting],
            [len(drafts[i]) for i in drafting],
            [proposal.sources[i] for i in drafting],
        )
        for i, depth in zip(drafting, chosen, strict=True):
            seq = items[i].seq
            if drafts[i]:
                self._free_drafts[seq.request_id] = _WholeDraft(drafts[i], proposal.sources[i], seq.num_tokens)
            drafts[i] = drafts[i][:depth]
        return drafts

    def _observe_free_draft_outcomes(self, items: list[ProposeItem]) -> None:
        """Score each request's last whole draft against the tokens it emitted since."""
        assert self.depth is not None
        for item in items:
            whole = self._free_drafts.pop(item.seq.request_id, None)
            if whole is not None:
                emitted = item.seq.token_slice(whole.position, whole.position + len(whole.tokens))
                self.depth.observe_outcome(item.seq.request_id, whole.tokens, emitted, whole.source)

    def observe_verification(self, seq: Sequence, num_drafted: int, num_accepted: int) -> None:
        if self.depth is not None and not self.capabilities.free_drafts:
            self.depth.observe_verification(seq.request_id, num_drafted, num_accepted)

    def observe_step(self, num_target_tokens: int, num_drafted: int, seconds: float, propose_seconds: float) -> None:
        if self.depth is not None:
            self.depth.observe_step(num_target_tokens, num_drafted, seconds, propose_seconds)

    def release(self, seq: Sequence) -> str | None:
        """Forget a request that finished, was aborted or preempted.

        Only a request that ended normally (stop or length) counts as complete output; aborted and
        preempted ones are discarded, so that proposers learning across requests keep nothing of them.
        Returns the proposer's error for this request when it could not finish its work for it.
        """
        self.drop_branches(seq)
        if self.depth is not None:
            self.depth.forget(seq.request_id)
        self._free_drafts.pop(seq.request_id, None)
        if seq.request_id not in self._known:
            return None
        self._known.discard(seq.request_id)
        if seq.finish_reason not in ("stop", "length"):
            self.proposer.discard_request(seq.request_id)
            return None
        try:
            self.proposer.finish_request(seq.request_id, seq.all_token_ids)
        except ProposerRequestError as exc:
            self.proposer.discard_request(seq.request_id)
            return str(exc)
        self.proposer.remove_request(seq.request_id)
        return None
