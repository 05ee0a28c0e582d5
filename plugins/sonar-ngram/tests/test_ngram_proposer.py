"""Both proposers over many engine steps: incremental buffers, preemption, slot reuse, identical drafts."""

from __future__ import annotations

import random

import pytest
import torch
from ngram_reference import reference_draft, repetitive_sequence
from sonar_ngram.proposer import NgramGPUProposer, NgramProposer

from sonar_core.spec_decode.prompt_lookup import LookupBounds
from sonar_core.spec_decode.proposer import ProposalRequest, ProposeBatch, Proposer

K = 5


def make_proposers(bounds: LookupBounds) -> list[Proposer]:
    return [
        NgramProposer(bounds),
        NgramGPUProposer(bounds, K, max_model_len=4096, device=torch.device("cpu")),
    ]


def batch_of(requests: list[ProposalRequest]) -> ProposeBatch:
    return ProposeBatch(
        requests=requests, block_size=16, kv_caches=[], device=torch.device("cpu")
    )


class SimulatedRequest:
    """A request as the engine drives it: tokens grow by accepted drafts plus one, and may be preempted."""

    def __init__(self, request_id: str, prompt: list[int]) -> None:
        self.request_id = request_id
        self.tokens = list(prompt)
        self.unproposed = len(prompt)

    def to_proposal(self, max_draft_tokens: int) -> ProposalRequest:
        request = ProposalRequest(
            request_id=self.request_id,
            token_ids=list(self.tokens),
            num_new_tokens=self.unproposed,
            max_draft_tokens=max_draft_tokens,
            block_table=[],
        )
        self.unproposed = 0
        return request

    def advance(self, rng: random.Random) -> None:
        added = rng.randint(1, 4)
        self.tokens.extend(rng.randrange(6) for _ in range(added))
        self.unproposed += added


@pytest.mark.parametrize("seed", range(4))
def test_drafts_match_the_reference_across_steps_preemptions_and_slot_reuse(seed: int) -> None:
    rng = random.Random(seed)
    bounds = LookupBounds(rng.randint(1, 3), rng.randint(3, 6))
    proposers = make_proposers(bounds)
    live: dict[str, SimulatedRequest] = {}
    next_id = 0
    for _step in range(60):
        # Arrivals (some without add_request, which the proposers must tolerate), finishes, preemptions.
        while len(live) < 12 and rng.random() < 0.5:
            request = SimulatedRequest(f"r{next_id}", repetitive_sequence(rng, rng.randint(1, 80)))
            next_id += 1
            live[request.request_id] = request
            if rng.random() < 0.8:
                for proposer in proposers:
                    proposer.add_request(request.request_id, request.tokens)
        for request_id in list(live):
            roll = rng.random()
            if roll < 0.05:
                del live[request_id]
                for proposer in proposers:
                    proposer.remove_request(request_id)
            elif roll < 0.1:
                for proposer in proposers:
                    proposer.remove_request(request_id)
                    proposer.add_request(request_id, live[request_id].tokens[:5])
                live[request_id].unproposed = len(live[request_id].tokens)
        if not live:
            continue
        requests = [r.to_proposal(rng.randint(0, K)) for r in live.values()]
        expected = [
            reference_draft(r.token_ids, bounds.min_n, bounds.max_n, r.max_draft_tokens) for r in requests
        ]
        for proposer in proposers:
            assert proposer.propose(batch_of(requests)).token_ids == expected, type(proposer).__name__
        for request in live.values():
            request.advance(rng)


def test_long_request_widens_the_device_rows() -> None:
    rng = random.Random(7)
    bounds = LookupBounds(2, 4)
    proposers = make_proposers(bounds)
    request = SimulatedRequest("long", repetitive_sequence(rng, 3000))
    for proposer in proposers:
        proposer.add_request("long", request.tokens)
    requests = [request.to_proposal(K)]
    expected = [reference_draft(request.tokens, 2, 4, K)]
    assert expected != [[]]
    for proposer in proposers:
        assert proposer.propose(batch_of(requests)).token_ids == expected


def test_empty_batch() -> None:
    for proposer in make_proposers(LookupBounds(1, 2)):
        assert proposer.propose(batch_of([])).token_ids == []
