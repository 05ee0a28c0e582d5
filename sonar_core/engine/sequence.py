"""A request's state inside the engine."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from sonar_core.engine.detokenizer import IncrementalDetokenizer
from sonar_core.outputs import RequestMetrics
from sonar_core.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request: its tokens, KV blocks, pending drafts and output bookkeeping.

    ``num_computed_tokens`` counts the leading tokens whose KV entries in the target's cache are
    valid. After a verify step it stops right after the last accepted draft, so the KV entries of
    rejected drafts are simply overwritten by the next step: that is the rollback.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None
    eos_token_ids: frozenset[int]
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    # Drafts proposed after the previous step, to be verified in the next one.
    draft_token_ids: list[int] = field(default_factory=list)
    # [len(draft_token_ids), vocab] draft probabilities, or None for one-hot drafts.
    draft_probs: torch.Tensor | None = None
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

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """``all_token_ids[start:end]`` without building the whole list."""
        prompt = self.prompt_token_ids
        if end <= len(prompt):
            return prompt[start:end]
        outputs = self.output_token_ids[max(start - len(prompt), 0) : end - len(prompt)]
        return prompt[start:] + outputs if start < len(prompt) else outputs

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def clear_drafts(self) -> None:
        self.draft_token_ids = []
        self.draft_probs = None
