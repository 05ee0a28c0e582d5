"""Prompt lookup in front of an EAGLE head (``prompt_lookup_min``/``max`` set on eagle/eagle3): the
lookup's drafts where the context repeats, the head's elsewhere; lossless greedy and sampled."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from aphrodite import LLM, SamplingParams
from sonar_core.engine.speculator import Speculator
from sonar_core.errors import ConfigError
from sonar_core.spec_decode.lookup_first import LookupFirstProposer
from sonar_core.spec_decode.prompt_lookup import LookupBounds
from sonar_core.spec_decode.proposer import (
    DraftProposal,
    ProposalRequest,
    ProposeBatch,
    Proposer,
    ProposerCapabilities,
)
from sonar_core.testing.branches import branch_on_every_step
from sonar_core.testing.losslessness import (
    assert_follows_target_distribution,
    constant_distribution_target,
    probabilistic_llm,
    sampled_output_distances,
)
from sonar_core.testing.plugin_checks import validate_for_target

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def _prompts() -> list[list[int]]:
    """Half copy themselves (lookup matches), half are random (the head drafts)."""
    rng = random.Random(3)
    copying = [[rng.randrange(3, 400) for _ in range(rng.randint(4, 9))] * 3 for _ in range(4)]
    fresh = [[rng.randrange(3, 400) for _ in range(rng.randint(2, 30))] for _ in range(4)]
    return copying + fresh


def _generate(target: Path, speculative_config=None) -> tuple[list[list[int]], LLM]:
    llm = LLM(model=str(target), dtype="float32", device="cpu", max_num_seqs=8, speculative_config=speculative_config)
    outputs = llm.generate(_prompts(), GREEDY, use_tqdm=False)
    manager = llm.engine.block_manager
    assert manager.num_free_blocks == manager.num_blocks, "KV blocks leaked"
    return [o.outputs[0].token_ids for o in outputs], llm


@pytest.mark.parametrize("branches", [1, 3])
def test_greedy_output_equals_plain_output(target, make_head, monkeypatch, branches):
    sources = {"lookup": 0, "head": 0}
    look_up = LookupFirstProposer._look_up

    def counting(self, request):
        drafts = look_up(self, request)
        if request.max_draft_tokens:
            sources["lookup" if drafts else "head"] += 1
        return drafts

    monkeypatch.setattr(LookupFirstProposer, "_look_up", counting)
    head = make_head(target, method="eagle3", layout="speculators", draft_vocab_size=128)
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 6, "prompt_lookup_max": 3,
              "num_draft_branches": branches, "draft_stop_confidence": 0}
    branched: list[int] = []
    drop = Speculator.drop_branches

    def recording(self, seq):
        branched.append(len(seq.draft_branches))
        drop(self, seq)

    monkeypatch.setattr(Speculator, "drop_branches", recording)
    branch_on_every_step(monkeypatch)
    tokens, llm = _generate(target, config)
    assert tokens == _generate(target)[0]
    # The head's drafts came with their branches; the lookup's never do.
    assert max(branched) == branches - 1
    assert isinstance(llm.engine.speculator.proposer, LookupFirstProposer)
    # Both sources drafted: the copying prompts through the lookup, the others through the head.
    assert sources["lookup"] > 0 and sources["head"] > 0
    assert llm.get_spec_decode_metrics().num_draft_tokens > 0


class RecordingHead(Proposer):
    """Drafts ``[900 + i for i < max_draft_tokens]`` with one-hot-free probability rows, and records
    what it was asked."""

    def __init__(self, vocab: int) -> None:
        self.vocab = vocab
        self.capabilities = ProposerCapabilities(returns_draft_probs=True)
        self.asked: list[int] = []

    def propose(self, batch: ProposeBatch) -> DraftProposal:
        self.asked = [r.max_draft_tokens for r in batch.requests]
        drafts = [[900 + i for i in range(r.max_draft_tokens)] for r in batch.requests]
        rows = sum(len(d) for d in drafts)
        return DraftProposal(drafts, torch.full((rows, self.vocab), 1.0 / self.vocab))


def _request(name: str, tokens: list[int], max_draft: int) -> ProposalRequest:
    return ProposalRequest(name, tokens, num_new_tokens=len(tokens), max_draft_tokens=max_draft, block_table=[])


def test_the_lookup_drafts_where_the_context_repeats_and_the_head_elsewhere():
    head = RecordingHead(vocab=1000)
    proposer = LookupFirstProposer(head, LookupBounds(1, 3), vocab_size=1000, head_depth=2)
    repeating = _request("a", [5, 6, 7, 8, 5, 6, 7], 5)
    fresh = _request("b", [1, 2, 3, 4], 5)
    idle = _request("c", [9, 9, 9], 0)
    proposal = proposer.propose(ProposeBatch(requests=[repeating, fresh, idle], block_size=16, kv_caches=[]))

    assert proposal.token_ids == [[8, 5, 6, 7, 8], [900, 901], []]
    # The head chained only for the request the lookup left without a draft, up to its own depth.
    assert head.asked == [0, 2, 0]
    # Lookup drafts are one-hot rows; the head's rows are its own.
    assert proposal.probs.shape == (7, 1000)
    assert torch.equal(proposal.probs[:5].argmax(dim=1), torch.tensor([8, 5, 6, 7, 8]))
    assert torch.equal(proposal.probs[:5].sum(dim=1), torch.ones(5))
    assert torch.allclose(proposal.probs[5:], torch.full((2, 1000), 1e-3))


def test_bad_lookup_bounds_are_refused(target, make_head):
    head = str(make_head(target, method="eagle3", layout="speculators", draft_vocab_size=128))
    with pytest.raises(ConfigError) as info:
        validate_for_target(target, "eagle", method="eagle3", model=head, prompt_lookup_min=0)
    assert info.value.field == "speculative_config.prompt_lookup_min" and "1 or more" in info.value.fix
    with pytest.raises(ConfigError) as info:
        validate_for_target(target, "eagle", method="eagle3", model=head, prompt_lookup_min=4, prompt_lookup_max=2)
    assert "greater than prompt_lookup_max=2" in info.value.message


def test_sampled_output_follows_the_target_distribution(target, tmp_path, make_head):
    """Probabilistic head drafts and one-hot lookup drafts mixed in one batch (four-token outputs
    over four tokens repeat often, so the lookup drafts on many steps) keep the target's distribution."""
    constant = constant_distribution_target(target, tmp_path / "constant")
    head = make_head(constant, method="eagle3", layout="speculators", draft_vocab_size=128)
    llm = probabilistic_llm(
        constant,
        {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2, "prompt_lookup_min": 1, "prompt_lookup_max": 2},
    )
    assert_follows_target_distribution(sampled_output_distances(llm))
    assert llm.get_spec_decode_metrics().num_draft_tokens > 0
