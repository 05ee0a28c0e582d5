"""Auto depth with a free-drafts proposer (prompt lookup): the engine asks for whole drafts, cuts
them per source, and learns from the whole drafts against what each request emitted, so a request
whose drafts were cut to nothing is still measured and gets drafts again once they would pay."""

from __future__ import annotations

import pytest
import torch
from sequences import make_sequence

from sonar_core.engine.block_manager import BlockManager
from sonar_core.engine.sequence import Sequence
from sonar_core.engine.speculator import ProposeItem, Speculator
from sonar_core.spec_decode.depth import WARMUP_STEPS
from sonar_core.spec_decode.proposer import DraftProposal, ProposeBatch, Proposer, ProposerCapabilities

DRAFT = [11, 12, 13, 14]


class _FixedDrafts(Proposer):
    """Drafts DRAFT (cut to each budget) for every request, labelled with the request's source."""

    capabilities = ProposerCapabilities(free_drafts=True)

    def __init__(self, sources: dict[str, int]) -> None:
        self.sources = sources
        self.budgets: list[int] = []

    def propose(self, batch: ProposeBatch) -> DraftProposal:
        self.budgets = [r.max_draft_tokens for r in batch.requests]
        return DraftProposal(
            [DRAFT[: r.max_draft_tokens] for r in batch.requests], sources=[self.sources[r.request_id] for r in batch.requests]
        )


def _speculator(proposer: Proposer) -> Speculator:
    speculator = Speculator(
        proposer, num_speculative_tokens=len(DRAFT), draft_max_model_len=10_000,
        block_manager=BlockManager(num_blocks=512, block_size=4), kv_caches=[], device=torch.device("cpu"),
        adaptive_depth=True,
    )
    # A step costs 10 ms plus 2 ms per target token: a draft pays when it is accepted 1 time in 6.
    for tokens in [1, 5, 2, 4, 1, 3, 5, 2, 1, 4] * 2:
        speculator.observe_step(tokens, 0, 0.010 + 0.002 * tokens, 0.0)
    assert speculator.depth is not None and speculator.depth.costs.num_steps >= WARMUP_STEPS
    return speculator


def _step(speculator: Speculator, seqs: list[Sequence], follows: dict[str, bool]) -> list[int]:
    """Propose, then emit what verification would: the drafts kept and one more token when the
    request follows the whole draft, else one token that differs from the first draft."""
    items = [ProposeItem(seq, len(DRAFT), slice(0, 0), 0, False) for seq in seqs]
    speculator.propose(items, None)
    depths = [len(seq.draft_token_ids) for seq in seqs]
    for seq in seqs:
        if follows[seq.request_id]:
            seq.output_token_ids.extend(DRAFT[: len(seq.draft_token_ids) + 1])
        else:
            seq.output_token_ids.append(99)
    return depths


def test_the_proposer_drafts_whole_budgets_and_auto_depth_cuts_per_request():
    proposer = _FixedDrafts({"good": 5, "poor": 2})
    speculator = _speculator(proposer)
    seqs = [make_sequence("good", [1, 2, 3]), make_sequence("poor", [1, 2, 3])]
    follows = {"good": True, "poor": False}
    for _ in range(30):
        depths = _step(speculator, seqs, follows)
        assert proposer.budgets == [len(DRAFT), len(DRAFT)]
    assert depths == [len(DRAFT), 0]


def test_cut_drafts_are_still_scored_so_a_request_gets_drafts_again():
    proposer = _FixedDrafts({"a": 3})
    speculator = _speculator(proposer)
    seqs = [make_sequence("a", [1, 2, 3])]
    for _ in range(30):
        _step(speculator, seqs, {"a": False})
    assert _step(speculator, seqs, {"a": True}) == [0]
    # Nothing is verified now, yet each step's emitted token scores the whole draft's first position,
    # and the deeper ones as the depth grows back.
    depths = [_step(speculator, seqs, {"a": True})[0] for _ in range(40)]
    assert depths[-1] == len(DRAFT)


def test_a_free_drafts_proposer_must_label_its_drafts():
    class _Unlabelled(_FixedDrafts):
        def propose(self, batch: ProposeBatch) -> DraftProposal:
            return DraftProposal([DRAFT[: r.max_draft_tokens] for r in batch.requests])

    speculator = _speculator(_Unlabelled({}))
    with pytest.raises(RuntimeError, match="declares free_drafts but returned no sources"):
        speculator.propose([ProposeItem(make_sequence("a", [1, 2, 3]), len(DRAFT), slice(0, 0), 0, False)], None)


def test_free_drafts_cannot_come_with_draft_probabilities():
    with pytest.raises(ValueError, match="one-hot"):
        ProposerCapabilities(free_drafts=True, returns_draft_probs=True)
