"""Autoregressive drafting from the target's hidden states (EAGLE-1, EAGLE-3, MTP).

A :class:`ChainDraftHead` turns ``(token, hidden)`` pairs into a draft hidden state and logits;
:class:`ChainProposer` drives any such head through one engine step:

1. **First pass**, over every request's new target positions (prefill chunks included): row ``t``
   pairs the target's state at position ``t`` with the token at ``t + 1`` and sits at RoPE
   position ``t``, so the token ids are the request's shifted left by one and the newest sampled
   token (the bonus) fills the last slot. This writes the draft's KV at exactly the positions the
   target just ran, replacing whatever the previous step's chain left there (the rollback), and
   leaves no hole however the prompt was chunked.
2. The first draft comes from each drafting request's last row.
3. **Chained steps** 2..k: the previous draft token and the head's own output state, one position
   further, with every step's metadata worked out once per chain
   (:class:`~sonar_core.spec_decode.draft_attention.DraftChain`).

With draft branches (``num_draft_branches`` > 1) a drafting request also gets the head's next best
first tokens, each continued as a chain of its own in a KV fork of the request
(``ProposeBatch.fork``, made after the first pass so the forks hold this step's draft KV); the
branches are rows of the same chained steps. Branches go where the head is unsure: a request whose
first draft has :data:`BRANCH_CONFIDENCE` of the head's probability drafts its chain alone.

A request stops chaining once none of its chains holds enough of the head's probability
(``speculative_config.draft_stop_confidence``, else :class:`ChainStops`' defaults; :class:`ChainDepths`),
reading the head's top probabilities back after each step: a deeper draft costs a draft pass and a
verified row per chain, and one the head gives little chance is seldom accepted.

Draft ids stay on the device for the whole chain and are read back once. The proposer keeps no
per-request state: every step's first pass starts from the target's states, so preemption,
recomputation and aborts need nothing from it.

The draft KV of a position that the target has run is therefore fixed by the tokens up to the
next one and written in the same step: a prefix-cached block keyed on its tokens and the one after
them (``prefix_cache_lookahead=1``) holds exactly the draft KV a request that hits it would write,
and the first pass of that request starts at its first uncached position.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
from torch import nn

from sonar_core.kv import KVCache, KVLayerSpec
from sonar_core.layers.attention import AttentionMetadata
from sonar_core.layers.linear import extra_rows_cost_little
from sonar_core.spec_decode.draft_attention import DraftChain, first_pass_metadata
from sonar_core.spec_decode.draft_sampling import DraftSample, DraftSampler
from sonar_core.spec_decode.proposer import (
    DraftBranch,
    DraftProposal,
    KVFork,
    ProposalRequest,
    ProposeBatch,
    Proposer,
    ProposerCapabilities,
    ProposerContext,
    TargetHiddenStates,
    drafting_last_rows,
)

# Chains a request may draft per step: its own and the head's next best first tokens'.
MAX_DRAFT_BRANCHES = 8
# The head's probability of its first draft from which that draft is taken as sure and the
# request gets no draft branches that step. Measured with the shipped EAGLE-3 head on the chat
# benchmark (600 steps, three chains of four): above 0.9 its first draft was right 94% of the time
# and a branch won 2% of those steps; from 0.8 to 0.9, 70% and 23%. Leaving those steps (27% of
# them) without branches kept 2.517 of 2.523 tokens a step.
BRANCH_CONFIDENCE = 0.9
# The probability of a chain (the product of the head's top probabilities along it) below which a
# request drafting its chain alone drafts no deeper on the CPU, unless draft_stop_confidence says
# otherwise: where a few more verified rows cost next to nothing (AMX tiles), and where each costs
# its multiply-adds. On accelerators chains alone are not cut by default: the cut reads the head's
# probabilities back after every draft pass, a device sync in a chain that otherwise reads back
# once, and it has not been measured there. Measured with the shipped EAGLE-3 head on the chat benchmark
# (docs/performance.md, "Chains that stop where the head is unsure"): on AMX, five or six drafts
# cut at 0.3 ran 4-10% faster than three uncut (0.4 alike); on the AVX2 build, six cut at 0.5 ran
# 1.33x plain against 1.26x at 0.3 and 1.12x for three uncut; on the AVX-512 BF16 path without
# AMX, 0.5 and 0.3 alike, 4-10% ahead of three uncut.
CHAIN_STOP_CONFIDENCE = 0.3
CHAIN_STOP_CONFIDENCE_DEAR_ROWS = 0.5
# The same for a request with draft branches (which pay only where rows cost little), where none
# of its chains holds this much. On the 600 steps above a cut at 0.1 kept 2.505 of 2.517 tokens a
# step and saved 0.5 ms of an 18.6 ms step; 0.3 measured as fast but accepted less (2.47 against
# 2.62 tokens a step at five drafts).
BRANCHES_STOP_CONFIDENCE = 0.1


@dataclass(frozen=True)
class ChainStops:
    """The chain probabilities below which a request drafts no deeper: drafting its chain alone,
    and with draft branches."""

    alone: float
    with_branches: float

    @classmethod
    def for_context(cls, context: ProposerContext) -> ChainStops:
        """``draft_stop_confidence`` where set, else the defaults for the device and dtype."""
        setting = context.speculative_config.draft_stop_confidence
        if setting is not None:
            return cls(setting, setting)
        if context.device.type != "cpu":
            alone = 0.0
        elif extra_rows_cost_little(context.device, context.dtype):
            alone = CHAIN_STOP_CONFIDENCE
        else:
            alone = CHAIN_STOP_CONFIDENCE_DEAR_ROWS
        return cls(alone, BRANCHES_STOP_CONFIDENCE)

    def of(self, branching: bool) -> float:
        return self.with_branches if branching else self.alone


class ChainDraftHead(nn.Module, ABC):
    """A draft head that predicts the next token from a token and a hidden state.

    Subclasses set ``target_hidden_layers`` (states in Sonar's index), ``target_final_hidden`` and
    ``kv_layers`` (one spec per attention layer of the head, in the order it uses ``kv_caches``).
    """

    target_hidden_layers: tuple[int, ...] = ()
    target_final_hidden: bool = False
    kv_layers: tuple[KVLayerSpec, ...] = ()

    def __init__(self) -> None:
        super().__init__()
        if not self.target_final_hidden and type(self).target_input is ChainDraftHead.target_input:
            raise TypeError(
                f"{type(self).__name__} does not read the target's final state (target_final_hidden is "
                "False), so it must define target_input for the layers it reads"
            )

    def target_input(self, target: TargetHiddenStates, rows: torch.Tensor) -> torch.Tensor:
        """``[R, H]``: the hidden input of the first pass for ``rows`` of the step's flat batch. By
        default the target's final state, for heads that declare ``target_final_hidden`` (EAGLE-1,
        MTP); heads that read other layers override it (checked when a head is made)."""
        return target.final.index_select(0, rows)

    @abstractmethod
    def forward(
        self,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        metadata: AttentionMetadata,
        step: int,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft pass over ``[R]`` tokens and ``[R, H]`` hidden states at ``positions``.

        Returns ``(out, carry)``: ``out`` feeds :meth:`compute_logits`, ``carry`` is the hidden state
        the next chained step reads. ``step`` is 0 for the first pass and counts chained steps.
        """

    @abstractmethod
    def compute_logits(self, out: torch.Tensor) -> torch.Tensor:
        """``[R, Vd]`` draft logits (the draft vocabulary; the sampler maps it to the target's)."""


class ChainProposer(Proposer):
    """Drives a :class:`ChainDraftHead` over the engine's steps (see the module docstring)."""

    def __init__(
        self, head: ChainDraftHead, sampler: DraftSampler, stops: ChainStops, max_depth: int | None = None
    ) -> None:
        self.head = head
        self.sampler = sampler
        self.stops = stops
        self.capabilities = ProposerCapabilities(
            target_hidden_layers=head.target_hidden_layers,
            target_final_hidden=head.target_final_hidden,
            kv_layers=head.kv_layers,
            returns_draft_probs=sampler.probabilistic,
            max_depth=max_depth,
            prefix_cache_lookahead=1,
            max_draft_branches=MAX_DRAFT_BRANCHES,
        )

    @torch.inference_mode()
    def propose(self, batch: ProposeBatch) -> DraftProposal:
        # A request that ended this step still gets the draft KV of its last positions: the
        # blocks they fill may be in the prefix cache for later requests.
        requests = [r for r in batch.requests if r.num_hidden_rows]
        drafting = [r for r in requests if r.max_draft_tokens > 0]
        if not requests or batch.target_hidden is None:
            return DraftProposal([[] for _ in batch.requests])
        out, carry = self._first_pass(batch, requests)
        if not drafting:
            return DraftProposal([[] for _ in batch.requests])
        last = drafting_last_rows([r.num_hidden_rows for r in requests], requests, batch.device)
        logits = self.head.compute_logits(out.index_select(0, last))
        # The head's confidence is read (a device sync) only where a request may branch, or where a
        # chain alone may stop (a request with branches stops by its branches' confidence too).
        may_branch = batch.fork is not None and any(r.max_draft_branches > 1 for r in drafting)
        may_stop = self.stops.alone > 0 and any(r.max_draft_tokens > 1 for r in drafting)
        first = self.sampler.sample(logits, self.sampler.batch_for(drafting), confidence=may_branch or may_stop)
        top = first.top_probabilities or [1.0] * len(drafting)
        # Forked only now: the first pass wrote the draft KV that the forks copy.
        forks = [
            batch.fork(r, r.max_draft_branches - 1) if r.max_draft_branches > 1 and confidence < BRANCH_CONFIDENCE else []
            for r, confidence in zip(drafting, top, strict=True)
        ]
        token_ids, probs = self._chain(batch, drafting, forks, logits, first, top, carry.index_select(0, last))
        proposal = DraftProposal.from_rows(batch.requests, drafting, token_ids[: len(drafting)], probs)
        if any(forks):
            proposal.branches = _branches(batch.requests, drafting, forks, token_ids[len(drafting) :], probs)
        return proposal

    def _first_pass(self, batch: ProposeBatch, requests: list[ProposalRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over every new target position; fills the draft KV of those positions."""
        metadata = first_pass_metadata(requests, batch.block_size, batch.device)
        next_tokens = [
            token for r in requests for token in r.token_ids[r.hidden_start + 1 : r.hidden_start + r.num_hidden_rows + 1]
        ]
        token_ids = torch.tensor(next_tokens, dtype=torch.int64, device=batch.device)
        hidden = self.head.target_input(batch.target_hidden, batch.hidden_row_index(requests))
        return self.head(token_ids, hidden, metadata.positions, batch.kv_caches, metadata, 0)

    def _chain(
        self,
        batch: ProposeBatch,
        requests: list[ProposalRequest],
        forks: list[list[KVFork]],
        logits: torch.Tensor,
        first: DraftSample,
        top: list[float],
        carry: torch.Tensor,
    ) -> tuple[list[list[int]], torch.Tensor | None]:
        """Chain the head from each request's first draft (``first``, sampled from ``logits``, where
        the head gave its top token ``top``); ``[R + B][<= k]`` ids and ``[R + B, k, V]``
        probabilities (probabilistic drafting): a row per request, then a row per draft branch
        (request by request), whose first draft is the next best after the request's and whose
        chain runs in its fork. A request's rows are cut to the depth :class:`ChainDepths` gives it."""
        first_ids, first_probs = first.token_ids, first.probs
        owners = [i for i, request_forks in enumerate(forks) for _ in request_forks]
        rows = requests + [requests[i] for i in owners]
        row_drafts = [r.max_draft_tokens for r in requests] + [requests[i].max_branch_draft_tokens for i in owners]
        tables = [r.block_table for r in requests] + [fork.block_table for request_forks in forks for fork in request_forks]
        confidences = list(top)
        if owners:
            alternatives, probabilities = self.sampler.alternatives(logits, first_ids, [len(f) for f in forks])
            branch_ids = [token for request_alternatives in alternatives for token in request_alternatives]
            confidences += [p for request_probabilities in probabilities for p in request_probabilities]
            owner_index = torch.tensor(owners, dtype=torch.int64, device=carry.device)
            first_ids = torch.cat([first_ids, torch.tensor(branch_ids, dtype=first_ids.dtype, device=first_ids.device)])
            carry = torch.cat([carry, carry.index_select(0, owner_index)])
            if first_probs is not None:
                first_probs = torch.cat([first_probs, first_probs.index_select(0, owner_index.to(first_probs.device))])
        stops = [self.stops.of(bool(request_forks)) for request_forks in forks]
        depths = ChainDepths(requests, list(range(len(requests))) + owners, row_drafts, confidences, stops)
        sampling = self.sampler.batch_for(rows)
        steps_ids, steps_probs = [first_ids], [first_probs]
        if depths.wanted(1):
            # The newest token sits at position len(token_ids) - 1; draft j (j >= 2) is predicted
            # from position len(token_ids) + j - 3.
            chain = DraftChain(
                [len(r.token_ids) - 1 for r in rows],
                [len(r.token_ids) + max(drafts, 2) - 3 for r, drafts in zip(rows, row_drafts, strict=True)],
                tables,
                batch.block_size,
                batch.device,
            )
            token_ids = first_ids
            step = 1
            while depths.wanted(step):
                metadata = chain.metadata()
                out, carry = self.head(token_ids, carry, chain.positions, batch.kv_caches, metadata, step)
                step_logits = self.head.compute_logits(out)
                sample = self.sampler.sample(step_logits, sampling, confidence=depths.tracking)
                token_ids = sample.token_ids
                steps_ids.append(sample.token_ids)
                steps_probs.append(sample.probs)
                chain.advance()
                step += 1
                depths.observe(sample.top_probabilities, step)
        token_rows = depths.cut(torch.stack(steps_ids, dim=1).tolist())
        probs = torch.stack(steps_probs, dim=1) if steps_probs[0] is not None else None
        return token_rows, probs


class ChainDepths:
    """How many drafts each request keeps: its ``max_draft_tokens``, or fewer once none of its
    chain rows that may still grow holds its ``stops`` entry of the head's probability (the product
    of the head's top probabilities along the row). Rows are a request's own chain and its draft
    branches (``row_requests`` gives each row's request, ``row_drafts`` the most it may draft). At
    least the first draft is always kept."""

    def __init__(
        self,
        requests: list[ProposalRequest],
        row_requests: list[int],
        row_drafts: list[int],
        confidences: list[float],
        stops: list[float],
    ) -> None:
        self.depths = [r.max_draft_tokens for r in requests]
        self.stops = stops
        # Whether the head's top probabilities are needed after each step (a device sync).
        self.tracking = any(stop > 0 for stop in stops)
        self._row_requests = row_requests
        self._row_drafts = row_drafts
        self._paths = confidences
        self._cut(1)

    @classmethod
    def of_chains(cls, requests: list[ProposalRequest], stop: float) -> ChainDepths:
        """One chain per request (no branches), cut at ``stop``, before its first draft:
        :meth:`observe` that with ``drafted=1``."""
        return cls(
            requests, list(range(len(requests))), [r.max_draft_tokens for r in requests], [1.0] * len(requests),
            [stop] * len(requests),
        )

    def wanted(self, drafted: int) -> bool:
        """Whether a request wants more than ``drafted`` drafts."""
        return any(depth > drafted for depth in self.depths)

    def of_row(self, row: int) -> int:
        """The drafts kept in chain row ``row``: its request's, at most the row's own (a branch
        carries fewer, :attr:`ProposalRequest.max_branch_draft_tokens`)."""
        return min(self.depths[self._row_requests[row]], self._row_drafts[row])

    def cut(self, token_rows: list[list[int]]) -> list[list[int]]:
        """Each chain row's drafts cut to :meth:`of_row`."""
        return [row[: self.of_row(i)] for i, row in enumerate(token_rows)]

    def observe(self, top: list[float] | None, drafted: int) -> None:
        """The head's top probability on every row at the step that made draft ``drafted`` (None
        where the step did not read it: nothing is cut, as nothing is :attr:`tracking`)."""
        if top is None:
            return
        self._paths = [path * p for path, p in zip(self._paths, top, strict=True)]
        self._cut(drafted)

    def _cut(self, drafted: int) -> None:
        best = [0.0] * len(self.depths)
        for row, request in enumerate(self._row_requests):
            if self._row_drafts[row] > drafted:  # a chain that may still grow
                best[request] = max(best[request], self._paths[row])
        for i, held in enumerate(best):
            if held < self.stops[i]:
                self.depths[i] = min(self.depths[i], drafted)


def _branches(
    requests: list[ProposalRequest],
    drafting: list[ProposalRequest],
    forks: list[list[KVFork]],
    token_rows: list[list[int]],
    probs: torch.Tensor | None,
) -> list[list[DraftBranch]]:
    """Per request of the batch, its draft branches from the chain's branch rows (request by
    request after the requests' own rows, already cut to their request's depth)."""
    by_id: dict[str, list[DraftBranch]] = {}
    row = 0
    for request, request_forks in zip(drafting, forks, strict=True):
        branches = by_id.setdefault(request.request_id, [])
        for fork in request_forks:
            tokens = token_rows[row]
            branch_probs = probs[len(drafting) + row, : len(tokens)] if probs is not None else None
            branches.append(DraftBranch(tokens, branch_probs, fork))
            row += 1
    return [by_id.get(request.request_id, []) for request in requests]
