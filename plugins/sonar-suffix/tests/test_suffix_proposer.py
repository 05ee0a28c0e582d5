"""The suffix proposer driven as the engine drives it: drafts, their lengths, and the request lifecycle."""

from __future__ import annotations

import random

import pytest
import torch
from sonar_suffix.options import SuffixOptions
from sonar_suffix.proposer import SuffixProposer, create_suffix_proposer

from sonar_core.spec_decode.proposer import ProposalRequest, ProposeBatch, ProposerContext

# An agent-like response: a structured sequence the model emits again and again.
RESPONSE = list(range(100, 140))


class Driver:
    """One request as the engine presents it: prompt + accepted output, new tokens since the last call."""

    def __init__(self, proposer: SuffixProposer, request_id: str, prompt: list[int], announce: bool = True):
        self.proposer = proposer
        self.request_id = request_id
        self.prompt = list(prompt)
        self.output: list[int] = []
        self.unproposed = len(prompt)
        if announce:
            proposer.add_request(request_id, self.prompt)

    def emit(self, tokens: list[int]) -> None:
        self.output.extend(tokens)
        self.unproposed += len(tokens)

    def propose(self, max_draft_tokens: int) -> list[int]:
        request = ProposalRequest(
            request_id=self.request_id,
            token_ids=self.prompt + self.output,
            num_new_tokens=self.unproposed,
            max_draft_tokens=max_draft_tokens,
            block_table=[],
        )
        self.unproposed = 0
        batch = ProposeBatch(requests=[request], block_size=16, kv_caches=[], device=torch.device("cpu"))
        proposal = self.proposer.propose(batch)
        (draft,) = proposal.token_ids
        (self.match_length,) = proposal.sources
        assert len(draft) <= max_draft_tokens
        return draft

    def generate(self, tokens: list[int], max_draft_tokens: int) -> list[int]:
        """Emit ``tokens`` one step at a time, accepting the matching prefix of each draft as a target
        would; return the number of drafted tokens accepted per step. As in the engine, nothing is
        proposed after the last step."""
        accepted: list[int] = []
        position = 0
        draft = self.propose(max_draft_tokens)
        while position < len(tokens):
            matched = 0
            while matched < len(draft) and position + matched < len(tokens) and draft[matched] == tokens[position + matched]:
                matched += 1
            accepted.append(matched)
            step = tokens[position : position + matched + 1]
            position += len(step)
            self.emit(step)
            if position < len(tokens):
                draft = self.propose(max_draft_tokens)
        return accepted


def make(**options: float) -> SuffixProposer:
    return SuffixProposer(SuffixOptions(**options))


def finish(proposer: SuffixProposer, request_id: str, prompt: list[int], response: list[int]) -> None:
    """One request from start to a complete output, ended as the engine ends it."""
    driver = Driver(proposer, request_id, prompt)
    driver.generate(response, max_draft_tokens=8)
    proposer.finish_request(request_id, [*prompt, *response])
    proposer.remove_request(request_id)


def test_drafts_continue_a_pattern_of_the_request_own_prompt() -> None:
    proposer = make()
    driver = Driver(proposer, "a", [1, 2, 3, 4, 5, 6, 7, 8, 9, 1, 2, 3, 4])
    assert driver.propose(4) == [5, 6, 7, 8]


def test_a_finished_response_drafts_a_later_request_that_repeats_it() -> None:
    proposer = make()
    finish(proposer, "first", [1, 2, 3], RESPONSE)
    second = Driver(proposer, "second", [7, 8, 9])
    accepted = second.generate(RESPONSE, max_draft_tokens=8)
    # Only the response tree knows RESPONSE (the second prompt shares no token with it). Drafts grow
    # with the match (max_spec_factor 1) up to the cap, so almost every token is drafted and accepted.
    assert sum(accepted) >= len(RESPONSE) - 10
    assert max(accepted) == 8


@pytest.mark.parametrize("told_the_ending", [True, False])
def test_the_last_steps_tokens_reach_the_cached_response(told_the_ending: bool) -> None:
    proposer = make()
    driver = Driver(proposer, "first", [1, 2, 3])
    # The response is drafted from nothing, so the last step emits one token that no propose sees.
    driver.generate(RESPONSE, max_draft_tokens=8)
    if told_the_ending:
        proposer.finish_request("first", [1, 2, 3, *RESPONSE])
    proposer.remove_request("first")
    follower = Driver(proposer, "f", [9, *RESPONSE[-5:-1]])
    assert follower.propose(4) == (RESPONSE[-1:] if told_the_ending else [])


def test_without_cached_responses_nothing_is_learnt_across_requests() -> None:
    proposer = make(suffix_decoding_max_cached_requests=0)
    finish(proposer, "first", [1, 2, 3], RESPONSE)
    second = Driver(proposer, "second", [7, 8, 9])
    assert sum(second.generate(RESPONSE, max_draft_tokens=8)) == 0


def test_draft_length_follows_the_match_length_times_the_spec_factor() -> None:
    for factor, expected in ((1.0, 1), (2.0, 2), (0.0, 0)):
        proposer = make(suffix_decoding_max_spec_factor=factor)
        finish(proposer, "first", [1, 2, 3], RESPONSE)
        # Only the last token (RESPONSE[10]) matches: a one-token match drafts factor * 1 tokens.
        second = Driver(proposer, "second", [7, 8, 9, RESPONSE[10]])
        assert second.propose(16) == RESPONSE[11 : 11 + expected]


def test_drafts_are_labelled_with_the_length_of_their_match() -> None:
    # For auto depth, which learns acceptance per label.
    proposer = make()
    finish(proposer, "first", [1, 2, 3], RESPONSE)
    second = Driver(proposer, "second", [7, 8, 9, *RESPONSE[8:11]])
    assert second.propose(16) and second.match_length == 3
    third = Driver(proposer, "third", [7, 8, 9, 99])
    assert second.propose(0) == [] and second.match_length == 0
    assert third.propose(16) == [] and third.match_length == 0


def test_drafts_stop_at_a_continuation_rarer_than_min_token_prob() -> None:
    branch = RESPONSE[:6]
    # After `branch`, three responses continue with 1 and one with 2: probability 0.75 vs 0.25.
    endings = [[1, 1, 1], [1, 1, 1], [1, 1, 1], [2, 2, 2]]
    for min_prob, expected in ((0.5, branch[3:] + [1, 1, 1]), (0.8, branch[3:])):
        proposer = make(suffix_decoding_min_token_prob=min_prob, suffix_decoding_max_spec_factor=4.0)
        for index, ending in enumerate(endings):
            finish(proposer, f"r{index}", [50 + index], branch + ending)
        driver = Driver(proposer, "next", [60, *branch[:3]])
        assert driver.propose(16) == expected


def test_drafts_never_exceed_the_tree_depth_nor_the_step_budget() -> None:
    proposer = make(suffix_decoding_max_tree_depth=5, suffix_decoding_max_spec_factor=10.0)
    finish(proposer, "first", [1], RESPONSE)
    driver = Driver(proposer, "second", [2])
    lengths = []
    for token in RESPONSE[:20]:
        driver.emit([token])
        lengths.append(len(driver.propose(16)))
    # The depth bounds match + draft, and the context match is at least one token.
    assert max(lengths) == 4
    assert driver.propose(2) == RESPONSE[20:22]
    assert driver.propose(0) == []


@pytest.mark.parametrize("seed", range(3))
def test_draft_lengths_vary_and_respect_every_budget(seed: int) -> None:
    rng = random.Random(seed)
    proposer = make(suffix_decoding_max_spec_factor=2.0)
    vocabulary = list(range(20))
    for index in range(6):
        finish(proposer, f"warm{index}", [rng.choice(vocabulary)], [rng.choice(vocabulary) for _ in range(60)])
    driver = Driver(proposer, "x", [rng.choice(vocabulary) for _ in range(30)])
    lengths = set()
    for _ in range(200):
        budget = rng.randint(0, 12)
        draft = driver.propose(budget)  # Driver.propose asserts len(draft) <= budget.
        lengths.add(len(draft))
        driver.emit(draft[: rng.randint(0, len(draft))] + [rng.choice(vocabulary)])
    assert len(lengths) > 3


def test_finish_keeps_the_response_and_discard_evicts_it() -> None:
    proposer = make()
    finish(proposer, "done", [1, 2], RESPONSE[:10])
    assert "done" in proposer.cache.cached_requests
    assert "done" not in proposer.cache.active_requests

    aborted = Driver(proposer, "aborted", [3, 4])
    aborted.generate(RESPONSE[20:30], max_draft_tokens=4)
    proposer.discard_request("aborted")
    assert "aborted" not in proposer.cache.active_requests
    assert "aborted" not in proposer.cache.cached_requests
    # Nothing of the aborted output is drafted for a later request.
    later = Driver(proposer, "later", [5, *RESPONSE[20:23]])
    assert later.propose(8) == []
    # Removing or discarding an unknown or already removed request is harmless.
    proposer.remove_request("aborted")
    proposer.discard_request("never-seen")


def test_a_preempted_request_resumes_without_counting_its_output_twice() -> None:
    proposer = make(suffix_decoding_min_token_prob=0.6, suffix_decoding_max_spec_factor=4.0)
    prompt = [1, 2, 3]
    driver = Driver(proposer, "p", prompt)
    driver.generate(RESPONSE[:15], max_draft_tokens=4)
    proposer.discard_request("p")  # preempted: the engine reports it as an incomplete output
    assert "p" not in proposer.cache.cached_requests
    # Resumed: announced with its prompt, first propose sees prompt + output so far as new.
    proposer.add_request("p", prompt)
    driver.unproposed = len(driver.prompt) + len(driver.output)
    driver.generate(RESPONSE[15:], max_draft_tokens=4)
    proposer.remove_request("p")
    assert list(proposer.cache.cached_requests) == ["p"]
    # The shared tree holds the whole RESPONSE once: a follower is drafted through the resumption
    # point with certainty (min_token_prob 0.6), which a lost or doubled first half would prevent.
    follower = Driver(proposer, "f", [9, *RESPONSE[10:14]])
    assert follower.propose(4) == RESPONSE[14:18]


def test_oldest_cached_responses_are_evicted_first() -> None:
    proposer = make(suffix_decoding_max_cached_requests=2)
    responses = [list(range(start, start + 12)) for start in (200, 300, 400)]
    for index, response in enumerate(responses):
        finish(proposer, f"r{index}", [index], response)
    assert list(proposer.cache.cached_requests) == ["r1", "r2"]
    # A request in flight takes a slot too: starting "y" evicts r1, the oldest, and keeps r2.
    assert Driver(proposer, "y", [9, *responses[2][:4]]).propose(4) == responses[2][4:8]
    assert list(proposer.cache.cached_requests) == ["r2", "y"]
    proposer.remove_request("y")
    assert Driver(proposer, "x", [9, *responses[0][:4]]).propose(4) == []


def test_an_unannounced_request_drafts_from_its_own_tokens_but_teaches_no_other() -> None:
    proposer = make()
    stray = Driver(proposer, "stray", [*RESPONSE[:12], *RESPONSE[:4]], announce=False)
    assert stray.propose(4) == RESPONSE[4:8]
    proposer.remove_request("stray")
    assert Driver(proposer, "other", [9, *RESPONSE[:4]]).propose(4) == []


def test_adding_an_active_request_again_restarts_it() -> None:
    proposer = make()
    first = Driver(proposer, "r", [1, 2, 3])
    first.generate(RESPONSE[:8], max_draft_tokens=4)
    again = Driver(proposer, "r", [1, 2, 3])
    assert list(proposer.cache.active_requests) == ["r"]
    assert again.propose(4) == []


def test_the_factory_uses_the_validated_options() -> None:
    options = SuffixOptions(suffix_decoding_max_tree_depth=7, suffix_decoding_max_cached_requests=3)
    context = ProposerContext(
        speculative_config=None,
        method_options=options,
        target_model=torch.nn.Identity(),
        target_hf_config=None,
        target_tokenizer=None,
        dtype=torch.float32,
        device=torch.device("cpu"),
        max_model_len=128,
    )
    proposer = create_suffix_proposer(context, None)
    assert proposer.options is options
    assert (proposer.cache.max_tree_depth, proposer.cache.max_cached_requests) == (7, 3)
