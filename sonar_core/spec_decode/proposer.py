"""The proposer interface that every speculation method implements.

The engine never branches on a method's name. What differs between methods is what a proposer
declares in :class:`ProposerCapabilities` (target hidden states it reads, KV layers it owns in the
paged cache, whether it returns draft probabilities, how many slots it needs) and the code of its
:meth:`Proposer.propose`. Proposers that draft from the target's hidden states build on the helpers
of :mod:`sonar_core.spec_decode` (draft attention, draft sampling, vocabulary maps, layer-index
conventions, checkpoint readers); docs/hidden-states.md describes them.

One engine step with speculation::

    schedule -> target runs over [last accepted token + drafts] per request
             -> rejection sampler keeps the valid prefix (+ recovered or bonus token)
             -> update requests -> proposer.propose(ProposeBatch) -> drafts for the next step
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from sonar_core.errors import SonarError
from sonar_core.kv import KVLayerSpec

if TYPE_CHECKING:
    from sonar_core.config import SpeculativeConfig
    from sonar_core.models.base import TargetModules
    from sonar_core.sampling_params import SamplingParams

# A draft branch carries this many drafts fewer than its request's own chain. A branch is the
# head's second or third guess at the first draft: where one won verification (116 of 600 steps
# of the chat workload, three chains of four, shipped EAGLE-3 head), 14 steps accepted its fourth
# draft, 2% of all steps; the row it takes is worth more as the own chain's next draft.
BRANCH_DRAFTS_SHORTER = 1


@dataclass(frozen=True)
class ProposerCapabilities:
    """What a proposer needs from the engine; the engine reads only these fields, never the method name."""

    # Target residual-stream states the proposer reads, in Sonar's index convention: state k is
    # the stream after k decoder layers (0: the embeddings; L: the last layer's output before the
    # final norm). sonar_core.spec_decode.layer_ids converts the published conventions. The engine
    # writes them into one persistent buffer whose column blocks follow this order, for every
    # token the target runs. Empty: nothing extra is captured and nothing is paid.
    target_hidden_layers: tuple[int, ...] = ()
    # True: ProposeBatch.target_hidden.final holds the target's final, post-norm state (the LM
    # head's input) for every token of the step (EAGLE-1, Medusa, MLP speculator, MTP).
    target_final_hidden: bool = False
    # KV layers the proposer owns. They live in the engine's paged cache and share each request's
    # block table, so a draft model's KV is allocated, preempted and freed with the request.
    kv_layers: tuple[KVLayerSpec, ...] = ()
    # True when propose() returns per-token draft probabilities (probabilistic drafting). Otherwise
    # drafts are treated as one-hot by the rejection sampler.
    returns_draft_probs: bool = False
    # Parallel (block) drafters: the query slots they place in one pass, from the position of the
    # request's newest token on. The engine keeps that many positions allocated for a drafting
    # request even when the step's draft budget is shorter than the block. 0: not a block drafter.
    draft_block_len: int = 0
    # KV slots a request needs beyond its tokens, drafts and draft block.
    extra_slots_per_request: int = 0
    # True: ProposeBatch.target_kv_caches holds the target's own KV caches, to read (never write):
    # for draft layers that attend over the target's keys and values (Gemma 4 assistants). A
    # request's committed positions (below its newest token) hold the target's KV there;
    # TargetModules.kv_producers says which cache holds which kind of layer's KV.
    reads_target_kv: bool = False
    # Largest draft depth the proposer supports; None means num_speculative_tokens decides.
    max_depth: int | None = None
    # Most draft branches per request (speculative_config.num_draft_branches): besides its own
    # chain, a request may get alternatives to its first draft, each continued as a chain of its
    # own and verified beside it in a KV fork of the request (ProposeBatch.fork). 1: chains only.
    max_draft_branches: int = 1
    # True: propose() drafts at next to no cost however long the drafts (prompt lookup, suffix
    # decoding), its drafts are one-hot (no probs), and DraftProposal.sources labels what each
    # request's drafts rest on. With depth_policy "auto" the engine then asks for whole budgets,
    # cuts each request's drafts to the depth that pays for their source, and learns acceptance
    # from the whole drafts against the tokens the request goes on to emit, cut ones included (a
    # one-hot draft is accepted exactly as often as the target's next token equals it).
    free_drafts: bool = False
    # Whether a request may start after blocks another request left in the prefix cache when the
    # proposer keeps KV layers or reads target states per position. None (the default): it may
    # not, since the proposer's data for cached positions would be missing or another request's;
    # prefix caching is then off. n: by the end of the step where the target fills a block
    # (prefill chunks, steps without drafts and the step that ends the request included), the
    # proposer has written its data of the block's positions t (its KV), from the target's states
    # there and the tokens up to t + n, and it reads nothing else per position; the cache then
    # keys each block on its tokens and the n after it, so a cached block holds the proposer data
    # this request would have written (the chain drafters: 1, as position t pairs the target's
    # state with token t + 1; a draft model and the block drafters: 0).
    prefix_cache_lookahead: int | None = None

    def __post_init__(self) -> None:
        if len(set(self.target_hidden_layers)) != len(self.target_hidden_layers):
            raise ValueError(f"target_hidden_layers must not repeat, got {self.target_hidden_layers}")
        if self.prefix_cache_lookahead is not None and self.prefix_cache_lookahead < 0:
            raise ValueError(f"prefix_cache_lookahead must be None or >= 0, got {self.prefix_cache_lookahead}")
        if self.free_drafts and self.returns_draft_probs:
            raise ValueError("free_drafts drafts are one-hot: a proposer cannot declare it with returns_draft_probs")
        if self.max_draft_branches < 1:
            raise ValueError(f"max_draft_branches must be at least 1, got {self.max_draft_branches}")

    @property
    def reads_target_hidden(self) -> bool:
        return bool(self.target_hidden_layers) or self.target_final_hidden


@dataclass
class TargetHiddenStates:
    """The target's hidden states for every token of one engine step's flat batch.

    Rows follow the flat batch of the target's forward (each request's tokens, then its drafts);
    a request's valid rows are ``ProposalRequest.hidden_rows``. The tensors are views of buffers
    the next step overwrites: read them during ``propose`` and copy what must outlive the call.
    """

    # The captured states' indices (ProposerCapabilities.target_hidden_layers), in column order.
    layers: tuple[int, ...]
    hidden_size: int
    # [T, len(layers) * hidden_size]: state layers[i] in columns i*H:(i+1)*H; None when no layers.
    aux: torch.Tensor | None = None
    # [T, hidden_size] final post-norm states; None unless target_final_hidden was asked for.
    final: torch.Tensor | None = None

    def layer(self, index: int) -> torch.Tensor:
        """``[T, hidden_size]`` state ``index`` (one of ``layers``)."""
        if self.aux is None or index not in self.layers:
            raise KeyError(f"target state {index} was not captured (captured: {self.layers})")
        column = self.layers.index(index) * self.hidden_size
        return self.aux[:, column : column + self.hidden_size]


@dataclass
class ProposalRequest:
    """One request's state when the engine asks for drafts.

    Every request the target ran this step is here, prefill chunks included: a request in the
    middle of a long prompt has ``max_draft_tokens == 0`` and ``is_partial_prefill``, and its
    hidden rows let a proposer keep its own KV cache or exported states free of holes.
    """

    request_id: str
    # Every known token of the request: its prompt plus every accepted output token, the newest
    # last. When the request sampled this step, the target has not yet run on the newest token and
    # the drafts continue after it. It is the request's own list, not a copy (copying it every
    # step would cost time quadratic in the output): read it, never modify it, and copy what must
    # outlive the call.
    token_ids: list[int]
    # Number of tokens at the end of token_ids appended since this request's previous propose
    # call (its whole length on the first call, or after a preemption).
    num_new_tokens: int
    # Upper bound for this request's draft length this step (0: do not draft).
    max_draft_tokens: int
    # Physical KV block ids covering at least len(token_ids) + max_draft_tokens
    # + extra_slots_per_request positions (and the draft block, for block drafters).
    block_table: list[int]
    # Rows of ProposeBatch.target_hidden holding this request's valid target positions from this
    # step (its prefill chunk, or its last accepted token and the accepted drafts), in order.
    hidden_rows: slice = field(default_factory=lambda: slice(0, 0))
    # The position of the first of hidden_rows: row i holds position hidden_start + i, whose next
    # token is token_ids[hidden_start + i + 1].
    hidden_start: int = 0
    # True for a chunk in the middle of a long prompt: the target has not reached the prompt's
    # end, nothing was sampled and nothing may be drafted.
    is_partial_prefill: bool = False
    # True when the request ended this step (a stop or its length): its last hidden rows are here
    # for proposers that keep them (an exporter); nothing is drafted, finish_request follows.
    is_finished: bool = False
    # The request's sampling parameters, for proposers that draft at the request's temperature.
    params: SamplingParams | None = None
    # The request's random generator when it is seeded (probabilistic drafting stays reproducible).
    generator: torch.Generator | None = None
    # Chains the request may get this step, its own included (see KVFork); 1: no branches.
    max_draft_branches: int = 1

    @property
    def num_hidden_rows(self) -> int:
        return self.hidden_rows.stop - self.hidden_rows.start

    @property
    def max_branch_draft_tokens(self) -> int:
        """Drafts a branch of this request may carry: :data:`BRANCH_DRAFTS_SHORTER` fewer than its
        own chain, at least one."""
        return max(1, self.max_draft_tokens - BRANCH_DRAFTS_SHORTER)


@dataclass
class KVFork:
    """A copy-on-write view of a request's KV blocks that a draft branch is drafted and verified in.

    ``block_table`` shares the request's blocks before the one holding its newest token and has
    blocks of its own (``own_blocks``) from there on, the filled part of the first one copied in
    every layer (the target's and the proposer's). Whatever a branch writes at the request's newest
    position and after stays in the fork; the engine copies a fork that won verification back into
    the request's blocks and frees every fork after the step.
    """

    block_table: list[int]
    own_blocks: list[int]
    # Index in block_table of the first own block.
    first_own: int


@dataclass
class DraftBranch:
    """An alternative chain of drafts for one request: its first token differs from the request's
    own first draft and from every other branch's."""

    token_ids: list[int]
    # [len(token_ids), vocab] draft probabilities (probabilistic drafting), or None (one-hot).
    probs: torch.Tensor | None
    fork: KVFork


@dataclass
class ProposeBatch:
    """Everything a proposer may read for one step."""

    requests: list[ProposalRequest]
    # Tokens per block of the paged KV cache.
    block_size: int
    # (key_cache, value_cache) for each layer in ProposerCapabilities.kv_layers, each of shape
    # [num_blocks, block_size, num_kv_heads, head_dim].
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    device: torch.device | None = None
    # The step's target states, when the capabilities ask for any.
    target_hidden: TargetHiddenStates | None = None
    # The target's own KV caches (in its kv_cache_specs order), when the capabilities ask for them.
    target_kv_caches: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    # fork(request, n): up to n KV forks of a request whose max_draft_branches > 1 (fewer when the
    # cache is short of blocks), made from its KV as it stands, so a proposer forks after writing
    # its own KV of the step's new positions. None when branching is off.
    fork: Callable[[ProposalRequest, int], list[KVFork]] | None = None

    def last_row_index(self, requests: list[ProposalRequest]) -> torch.Tensor:
        """``[R]`` int64: each request's last valid row of ``target_hidden`` (its newest position
        the target read, whose state heads like Medusa and the MLP speculator draft from)."""
        rows = [r.hidden_rows.stop - 1 for r in requests]
        return torch.tensor(rows, dtype=torch.int64, device=self.device)

    def hidden_row_index(self, requests: list[ProposalRequest] | None = None) -> torch.Tensor:
        """``[R]`` int64 rows of ``target_hidden`` holding the valid positions of ``requests``
        (all by default), request by request, in position order."""
        chosen = self.requests if requests is None else requests
        rows = [row for r in chosen for row in range(r.hidden_rows.start, r.hidden_rows.stop)]
        return torch.tensor(rows, dtype=torch.int64, device=self.device)


def drafting_last_rows(lengths: list[int], requests: list[ProposalRequest], device: torch.device) -> torch.Tensor:
    """``[D]`` int64: in one pass whose rows run request by request (``lengths[i]`` rows for
    ``requests[i]``), the last row of each request that drafts: where its first draft is read."""
    rows, end = [], 0
    for length, request in zip(lengths, requests, strict=True):
        end += length
        if request.max_draft_tokens > 0:
            rows.append(end - 1)
    return torch.tensor(rows, dtype=torch.int64, device=device)


@dataclass
class DraftProposal:
    """Drafts for one step, in ProposeBatch.requests order."""

    # Draft token ids per request; each list no longer than its request's max_draft_tokens.
    token_ids: list[list[int]]
    # [sum of draft lengths, vocab_size] draft probabilities, rows in request order, when the
    # proposer declares returns_draft_probs; otherwise None (one-hot drafts).
    probs: torch.Tensor | None = None
    # Per request, what its drafts rest on (prompt lookup: the matched n-gram length), for
    # proposers that declare free_drafts; auto depth learns acceptance per source.
    sources: list[Hashable] | None = None
    # Per request, its draft branches (each in a fork from ProposeBatch.fork), when any.
    branches: list[list[DraftBranch]] | None = None

    @classmethod
    def from_rows(
        cls,
        requests: list[ProposalRequest],
        drafting: list[ProposalRequest],
        token_rows: list[list[int]],
        probs: torch.Tensor | None = None,
    ) -> DraftProposal:
        """The proposal of a batch from drafts made for ``drafting`` (a subset of ``requests``):
        row ``i`` of ``token_rows`` (and of ``probs``, ``[len(drafting), k, V]``) belongs to
        ``drafting[i]`` and is cut to its ``max_draft_tokens``; other requests get no drafts."""
        by_id = {r.request_id: row for row, r in enumerate(drafting)}
        drafts: list[list[int]] = []
        prob_rows: list[torch.Tensor] = []
        for request in requests:
            row = by_id.get(request.request_id)
            if row is None:
                drafts.append([])
                continue
            drafts.append(token_rows[row][: request.max_draft_tokens])
            if probs is not None:
                prob_rows.append(probs[row, : len(drafts[-1])])
        return cls(drafts, torch.cat(prob_rows) if prob_rows else None)


class SplitModelLoader(Protocol):
    """Loads the draft model split over the target's tensor-parallel ranks (the engine's workers)."""

    def load_model(self, **load_model_arguments: Any) -> Any:
        """``sonar_core.models.loader.load_model(**load_model_arguments)`` on every rank; returns
        the driver's ``LoadedModel``, whose model runs every rank's share at each forward pass."""


@dataclass
class ProposerContext:
    """What the engine hands a method's factory when it builds the proposer."""

    speculative_config: SpeculativeConfig
    # The method's validated options (the plugin's own pydantic model), or None.
    method_options: Any
    target_model: torch.nn.Module
    target_hf_config: Any
    target_tokenizer: Any
    dtype: torch.dtype
    device: torch.device
    # Maximum total length (prompt + output) of a request.
    max_model_len: int
    # The target's embedding, final norm and LM head, to share instead of copying.
    target_modules: TargetModules | None = None
    # The target checkpoint's folder (config.json and weights), for methods whose draft weights
    # ship inside it (see the sonar_claim_target_tensors hook).
    target_model_dir: Path | None = None
    # Most tokens the target runs in one step (the rows of a step's hidden states).
    max_num_batched_tokens: int = 0
    # Most requests in one step.
    max_num_seqs: int = 0
    # Set when draft_tensor_parallel_size equals the target's (> 1): a method that loads a
    # separate draft model loads it split over the same ranks with
    # ``split_draft.load_model(**load_model_arguments)``. None: the draft runs whole, on the driver.
    split_draft: SplitModelLoader | None = None


class ProposerRequestError(SonarError):
    """A proposer could not finish its work for one request (an export it could not write).

    Raised from :meth:`Proposer.finish_request`; that request fails with this message (HTTP 500 on
    the server, ``RequestOutput.error`` offline) and every other request goes on.
    """


class Proposer(ABC):
    """A speculation method's drafting logic. Subclasses set ``capabilities``."""

    capabilities: ProposerCapabilities = ProposerCapabilities()

    @abstractmethod
    def propose(self, batch: ProposeBatch) -> DraftProposal:
        """Return drafts for every request of the batch (an empty list where it has none)."""

    def add_request(self, request_id: str, prompt_token_ids: list[int]) -> None:  # noqa: B027
        """Called when a request starts or resumes after a preemption. Default: nothing to track."""

    def finish_request(self, request_id: str, token_ids: list[int]) -> None:  # noqa: B027
        """Called when a request ended with a complete output (a stop or its length), just before
        :meth:`remove_request`, with its prompt and every output token (the request's own list:
        read-only, as in :class:`ProposalRequest`).

        The tokens of a request's last step never reach :meth:`propose` (nothing is drafted after
        the end), so proposers that learn from finished outputs (suffix decoding) take them here.
        Raise :class:`ProposerRequestError` when the request's own work cannot be completed (its
        export could not be written): the request fails, the others are unaffected. Default:
        nothing to learn.
        """

    def remove_request(self, request_id: str) -> None:  # noqa: B027
        """Called when a request finishes, is aborted or preempted. Must drop all its state."""

    def discard_request(self, request_id: str) -> None:
        """Called instead of :meth:`remove_request` when a request leaves without a complete output
        (aborted or preempted), by engines that tell the two apart.

        Proposers that learn from finished outputs across requests (suffix decoding) override it to
        forget what they learnt from the incomplete one. Default: the same as remove_request.
        """
        self.remove_request(request_id)
