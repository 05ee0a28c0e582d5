"""The proposer interface that every speculation method implements.

The engine never branches on a method's name. What differs between methods is what a proposer
declares in :class:`ProposerCapabilities` (target hidden states it reads, KV layers it owns in the
paged cache, whether it returns draft probabilities, how many slots it needs) and the code of its
:meth:`Proposer.propose`.

One engine step with speculation::

    schedule -> target runs over [last accepted token + drafts] per request
             -> rejection sampler keeps the valid prefix (+ recovered or bonus token)
             -> update requests -> proposer.propose(ProposeBatch) -> drafts for the next step
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from sonar_core.config import SpeculativeConfig
    from sonar_core.sampling_params import SamplingParams


@dataclass(frozen=True)
class KVLayerSpec:
    """Shape of one attention layer's KV cache that a proposer owns in the shared paged cache."""

    num_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class ProposerCapabilities:
    """What a proposer needs from the engine; the engine reads only these fields, never the method name."""

    # Indices of target decoder layers whose output hidden states the proposer reads (EAGLE-style
    # methods). Empty: the target's forward captures nothing extra and pays nothing.
    target_hidden_layers: tuple[int, ...] = ()
    # KV layers the proposer owns. They live in the engine's paged cache and share each request's
    # block table, so a draft model's KV is allocated, preempted and freed with the request.
    kv_layers: tuple[KVLayerSpec, ...] = ()
    # True when propose() returns per-token draft probabilities (probabilistic drafting). Otherwise
    # drafts are treated as one-hot by the rejection sampler.
    returns_draft_probs: bool = False
    # Tokens a proposer drafts per pass; greater than 1 for parallel (block) drafting.
    block_size: int = 1
    # KV slots a request needs beyond its tokens and drafts (e.g. mask positions of a block model).
    extra_slots_per_request: int = 0
    # Largest draft depth the proposer supports; None means num_speculative_tokens decides.
    max_depth: int | None = None


@dataclass
class ProposalRequest:
    """One request's state when the engine asks for drafts."""

    request_id: str
    # Prompt plus every accepted output token, the newest last. The target has not yet run on the
    # last token; the drafts continue after it.
    token_ids: list[int]
    # Number of tokens at the end of token_ids appended since this request's previous propose
    # call (its whole length on the first call, or after a preemption).
    num_new_tokens: int
    # Upper bound for this request's draft length this step (0: do not draft).
    max_draft_tokens: int
    # Physical KV block ids covering at least len(token_ids) + max_draft_tokens
    # + extra_slots_per_request positions.
    block_table: list[int]
    # Rows of ProposeBatch.target_hidden holding this request's valid (accepted) target positions
    # from this step, ordered by position; the last row belongs to token_ids[-2].
    hidden_rows: slice = field(default_factory=lambda: slice(0, 0))
    # The request's sampling parameters, for proposers that draft at the request's temperature.
    params: SamplingParams | None = None
    # The request's random generator when it is seeded (probabilistic drafting stays reproducible).
    generator: torch.Generator | None = None


@dataclass
class ProposeBatch:
    """Everything a proposer may read for one step."""

    requests: list[ProposalRequest]
    block_size: int
    # (key_cache, value_cache) for each layer in ProposerCapabilities.kv_layers, each of shape
    # [num_blocks, block_size, num_kv_heads, head_dim].
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]
    # layer index -> [num_rows, hidden_size] hidden states of the target's valid positions this step,
    # for the layers in ProposerCapabilities.target_hidden_layers.
    target_hidden: dict[int, torch.Tensor]
    device: torch.device


@dataclass
class DraftProposal:
    """Drafts for one step, in ProposeBatch.requests order."""

    # Draft token ids per request; each list no longer than its request's max_draft_tokens.
    token_ids: list[list[int]]
    # [sum of draft lengths, vocab_size] draft probabilities, rows in request order, when the
    # proposer declares returns_draft_probs; otherwise None (one-hot drafts).
    probs: torch.Tensor | None = None


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
        :meth:`remove_request`, with its prompt and every output token.

        The tokens of a request's last step never reach :meth:`propose` (nothing is drafted after
        the end), so proposers that learn from finished outputs (suffix decoding) take them here.
        Default: nothing to learn.
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
