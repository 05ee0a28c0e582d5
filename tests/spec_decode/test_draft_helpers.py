"""Core's helpers for hidden-state drafters: chained draft metadata, vocabulary maps, layer-index
conventions, draft sampling, the speculators config reader."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from sonar_core.config import TargetInfo
from sonar_core.errors import ConfigError
from sonar_core.layers.attention import AttentionMetadata
from sonar_core.layers.linear import extra_rows_cost_little
from sonar_core.sampling_params import SamplingParams
from sonar_core.spec_decode import layer_ids
from sonar_core.spec_decode.chain_proposer import (
    BRANCHES_STOP_CONFIDENCE,
    CHAIN_STOP_CONFIDENCE,
    CHAIN_STOP_CONFIDENCE_DEAR_ROWS,
    ChainDepths,
    ChainStops,
)
from sonar_core.spec_decode.draft_attention import DraftChain, block_metadata
from sonar_core.spec_decode.draft_sampling import DraftSampler
from sonar_core.spec_decode.proposer import ProposalRequest
from sonar_core.spec_decode.speculators_format import SpeculatorsConfig, checkpoint_name
from sonar_core.spec_decode.vocab_map import DraftVocabularyMap

BLOCK = 4


def test_a_chain_step_equals_metadata_built_from_host_lists():
    tables = [[7, 2, 9], [4, 1], [3, 8, 6, 5]]
    first, last = [5, 3, 10], [9, 5, 11]
    chain = DraftChain(first, last, tables, BLOCK, "cpu")
    positions = list(first)
    for _ in range(5):
        device = chain.metadata()
        host = AttentionMetadata.build([1] * 3, [p + 1 for p in positions], tables, BLOCK, torch.device("cpu"))
        assert device.positions.tolist() == host.positions.tolist() == positions
        assert device.slot_mapping.tolist() == host.slot_mapping.tolist()
        assert device.seq_lens.tolist() == host.seq_lens.tolist()
        assert device.max_seq_len == host.max_seq_len
        assert torch.equal(device.attn_mask, host.attn_mask)
        chain.advance()
        positions = [min(p + 1, stop) for p, stop in zip(positions, last, strict=True)]


def test_a_chain_refuses_positions_its_blocks_do_not_hold():
    with pytest.raises(ValueError, match="cannot hold position 8"):
        DraftChain([5], [8], [[1, 2]], BLOCK, "cpu")


def test_block_metadata_lets_every_slot_see_its_whole_block():
    metadata = block_metadata([6, 2], 3, [[0, 1, 2], [3, 4]], BLOCK, "cpu")
    assert metadata.positions.tolist() == [6, 7, 8, 2, 3, 4]
    mask = metadata.attn_mask[:, 0]
    assert mask[0].all()  # the first request sees its 9 positions from every slot
    assert mask[1, :, :5].all() and not mask[1, :, 5:].any()


def test_vocabulary_map_from_offsets():
    used = torch.tensor([0, 3, 4, 9])
    d2t = used - torch.arange(4)
    t2d = torch.zeros(12, dtype=torch.bool)
    t2d[used] = True
    vocab = DraftVocabularyMap.from_d2t(d2t, 12, 4, t2d)
    assert vocab.to_target(torch.tensor([2, 0, 3])).tolist() == [4, 0, 9]
    logits = vocab.scatter_logits(torch.tensor([[1.0, 2.0, 3.0, 4.0]]))
    assert logits[0, used].tolist() == [1.0, 2.0, 3.0, 4.0] and torch.isinf(logits).sum() == 8
    probs = vocab.scatter_probs(torch.tensor([[0.1, 0.2, 0.3, 0.4]]))
    assert probs.sum().item() == pytest.approx(1.0) and probs[0, 9].item() == pytest.approx(0.4)


@pytest.mark.parametrize(
    ("d2t", "t2d", "message"),
    [
        (torch.zeros(3, dtype=torch.long), None, "d2t has shape (3,), but draft_vocab_size is 4"),
        (torch.tensor([0, 0, 0, 20]), None, "outside the target vocabulary of 12"),
        (torch.tensor([0, 0, -1, 0]), None, "increasing target ids"),
        (torch.zeros(4, dtype=torch.long), torch.ones(5, dtype=torch.bool), "t2d has shape (5,)"),
        (torch.zeros(4, dtype=torch.long), torch.ones(12, dtype=torch.bool), "t2d marks 12 target tokens"),
    ],
)
def test_vocabulary_maps_that_do_not_fit_are_refused(d2t, t2d, message):
    with pytest.raises(ConfigError) as info:
        DraftVocabularyMap.from_d2t(d2t, 12, 4, t2d, source="the head")
    assert message in info.value.message and "the head" in info.value.message


def test_layer_index_conventions():
    assert layer_ids.from_capture_ids([2, 16, 29]) == (2, 16, 29)
    assert layer_ids.from_dflash_target_layer_ids([-1, 1, 9]) == (0, 2, 10)
    assert layer_ids.from_hf_hidden_states_indices([0, 5, 32], 32) == ((0, 5), True)
    assert layer_ids.eagle3_default_layers(32) == (2, 16, 29)
    with pytest.raises(ConfigError, match=r"\[33\], outside the target's 0..32"):
        layer_ids.check_layers((2, 33), 32, "model", "the head")


def _request(seed: int | None, temperature: float) -> ProposalRequest:
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    params = SamplingParams(temperature=temperature, seed=seed)
    return ProposalRequest("r", [1], 1, 2, [0], params=params, generator=generator)


def test_greedy_drafting_maps_the_argmax_to_target_ids():
    vocab = DraftVocabularyMap(torch.tensor([3, 5, 8]), 10)
    sample = DraftSampler(vocab, probabilistic=False, device="cpu").sample(torch.tensor([[0.0, 2.0, 1.0]]), None)
    assert sample.token_ids.tolist() == [5] and sample.probs is None


def test_the_heads_top_probabilities_and_its_next_best_tokens():
    sampler = DraftSampler(DraftVocabularyMap(torch.tensor([3, 5, 8]), 10), probabilistic=False, device="cpu")
    logits = torch.tensor([[0.0, math.log(18.0), 0.0], [1.0, 0.0, 2.0]])
    assert sampler.top_probabilities(logits) == pytest.approx([0.9, math.e**2 / (math.e**2 + math.e + 1)])
    assert sampler.top_probabilities(logits.to(torch.bfloat16)) == pytest.approx([0.9, 0.665], abs=2e-3)
    first = sampler.sample(logits, None).token_ids
    assert sampler.sample(logits, None).top_probabilities is None  # only where asked for
    confident = sampler.sample(logits, None, confidence=True)  # the pick's kernel call
    assert confident.token_ids.tolist() == first.tolist() == [5, 8]
    assert confident.top_probabilities == pytest.approx(sampler.top_probabilities(logits))
    probabilistic = DraftSampler(sampler.vocab_map, probabilistic=True, device="cpu")
    drawn = probabilistic.sample(logits, probabilistic.batch_for([_request(1, 1.0), _request(None, 0.0)]), True)
    assert drawn.top_probabilities == pytest.approx(sampler.top_probabilities(logits))
    tokens, probabilities = sampler.alternatives(logits, first, [2, 1])
    assert tokens == [[3, 8], [3]]  # target ids, the chosen draft left out, most likely first
    assert probabilities[0] == pytest.approx([0.05, 0.05])
    assert probabilities[1] == pytest.approx([math.e / (math.e**2 + math.e + 1)])


def test_a_request_stops_where_its_chains_run_out_of_probability():
    requests = [SimpleNamespace(max_draft_tokens=4), SimpleNamespace(max_draft_tokens=4),
                SimpleNamespace(max_draft_tokens=3), SimpleNamespace(max_draft_tokens=4)]
    # Rows: the own chains of requests 0 to 3, then request 0's two branches. Requests 1 and 2
    # draft alone and their first drafts hold less than the stop; request 3's holds more.
    stop = 0.1
    # Request 0's branches carry three drafts, one fewer than its own chain.
    depths = ChainDepths(requests, [0, 1, 2, 3, 0, 0], [4, 4, 3, 4, 3, 3], [0.5, 0.01, 0.9 * stop, 0.6, 0.3, 0.2],
                         [stop] * 4)
    assert depths.depths == [4, 1, 1, 4] and depths.tracking
    depths.observe([0.5] * 6, drafted=2)  # request 0's best chain: 0.25, request 3's 0.3
    assert depths.depths == [4, 1, 1, 4]
    # Request 0: 0.075 on its own chain; its branches, done at three drafts, no longer count.
    depths.observe([0.3, 0.01, 0.5, 0.5, 0.3, 0.3], drafted=3)
    assert depths.depths == [3, 1, 1, 4]
    assert [depths.of_row(row) for row in range(6)] == [3, 1, 1, 4, 3, 3]
    assert depths.wanted(3) and not depths.wanted(4)


def test_a_stop_of_zero_drafts_every_chain_to_its_depth():
    requests = [SimpleNamespace(max_draft_tokens=3), SimpleNamespace(max_draft_tokens=2)]
    depths = ChainDepths.of_chains(requests, 0.0)
    assert not depths.tracking and depths.wanted(1)
    assert [depths.of_row(row) for row in range(2)] == [3, 2]


def _stops(setting: float | None, device: str, dtype: torch.dtype) -> ChainStops:
    context = SimpleNamespace(speculative_config=SimpleNamespace(draft_stop_confidence=setting),
                              device=torch.device(device), dtype=dtype)
    return ChainStops.for_context(context)


def test_unset_stops_follow_what_a_verified_row_costs():
    # Float32 on the CPU multiplies every row (no AMX tiles); bfloat16 on AMX tiles costs little.
    assert _stops(None, "cpu", torch.float32) == ChainStops(CHAIN_STOP_CONFIDENCE_DEAR_ROWS, BRANCHES_STOP_CONFIDENCE)
    cheap = CHAIN_STOP_CONFIDENCE if extra_rows_cost_little(torch.device("cpu"), torch.bfloat16) else (
        CHAIN_STOP_CONFIDENCE_DEAR_ROWS)
    assert _stops(None, "cpu", torch.bfloat16) == ChainStops(cheap, BRANCHES_STOP_CONFIDENCE)
    # Accelerators: chains alone uncut (a cut reads back after every pass), branches as on the CPU.
    assert _stops(None, "cuda", torch.bfloat16) == ChainStops(0.0, BRANCHES_STOP_CONFIDENCE)
    assert _stops(0.0, "cpu", torch.float32) == ChainStops(0.0, 0.0)
    assert not ChainDepths.of_chains([SimpleNamespace(max_draft_tokens=3)], _stops(0.0, "cpu", torch.float32).alone).tracking
    stops = ChainStops(CHAIN_STOP_CONFIDENCE, BRANCHES_STOP_CONFIDENCE)
    requests = [SimpleNamespace(max_draft_tokens=3)]
    # A chain between the two defaults: kept by a request with branches, cut by one alone.
    between = (stops.alone + stops.with_branches) / 2
    assert ChainDepths(requests, [0], [3], [between], [stops.of(branching=True)]).depths == [3]
    assert ChainDepths(requests, [0], [3], [between], [stops.of(branching=False)]).depths == [1]


def test_chains_observed_from_their_first_draft_stop_like_chains_given_it():
    """ChainDepths.of_chains (drafters whose loop makes the first draft too) cuts as the chain
    proposer's ChainDepths given the first draft's probability does."""
    requests = [SimpleNamespace(max_draft_tokens=3), SimpleNamespace(max_draft_tokens=3)]
    observed = ChainDepths.of_chains(requests, 0.3)
    assert observed.depths == [3, 3]
    observed.observe([0.2, 0.9], drafted=1)
    given = ChainDepths(requests, [0, 1], [3, 3], [0.2, 0.9], [0.3, 0.3])
    assert observed.depths == given.depths == [1, 3]


def test_a_branch_that_has_all_its_drafts_no_longer_keeps_its_request_chaining():
    requests = [SimpleNamespace(max_draft_tokens=4)]
    stop = 0.1
    # The own chain (four drafts) and one branch of two: the branch is the surer of the two.
    depths = ChainDepths(requests, [0, 0], [4, 2], [2 * stop, 0.9], [stop])
    depths.observe([0.6, 0.9], drafted=2)  # own chain 1.2 x stop, the branch done at two drafts
    assert depths.depths == [4] and [depths.of_row(row) for row in range(2)] == [4, 2]
    depths.observe([0.5, 0.9], drafted=3)  # own chain 0.6 x stop: the finished branch does not count
    assert depths.depths == [3] and [depths.of_row(row) for row in range(2)] == [3, 2]


def test_probabilistic_drafting_is_seeded_per_request_and_reports_target_probabilities():
    vocab = DraftVocabularyMap(torch.tensor([3, 5, 8]), 10)
    sampler = DraftSampler(vocab, probabilistic=True, device="cpu")
    logits = torch.tensor([[0.5, 0.2, 0.1]] * 2)

    def draw(seed: int) -> list[int]:
        requests = [_request(seed, 1.0), _request(None, 0.0)]
        batch = sampler.batch_for(requests)
        return [sampler.sample(logits, batch).token_ids.tolist() for _ in range(20)]

    assert draw(7) == draw(7)
    sample = sampler.sample(logits, sampler.batch_for([_request(1, 1.0), _request(None, 0.0)]))
    assert sample.probs.shape == (2, 10)
    assert torch.allclose(sample.probs[0, [3, 5, 8]], logits[0].softmax(-1))
    assert sample.probs[1].tolist() == [0.0] * 3 + [1.0] + [0.0] * 6  # a greedy request: one-hot argmax
    assert sample.token_ids[1].item() == 3


def test_speculators_config_reader_and_verifier_names():
    config = {
        "speculators_model_type": "eagle3",
        "architectures": ["Eagle3Speculator"],
        "transformer_layer_config": {"model_type": "llama"},
        "draft_vocab_size": 32000,
        "speculators_config": {
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
            "verifier": {"name_or_path": "meta-llama/Llama-3.1-8B-Instruct", "architectures": ["LlamaForCausalLM"]},
        },
    }
    spec = SpeculatorsConfig.from_config(config)
    assert (spec.model_type, spec.speculative_tokens, spec.draft_vocab_size) == ("eagle3", 3, 32000)
    assert SpeculatorsConfig.from_config({"architectures": ["LlamaForCausalLM"]}) is None
    cached = "/h/hub/models--meta-llama--Llama-3.1-8B-Instruct/snapshots/abc123/config.json"
    assert checkpoint_name(cached) == "meta-llama/Llama-3.1-8B-Instruct"
    assert checkpoint_name("/models/SmolLM2-135M-Instruct.Q4_K_M.gguf") == "SmolLM2-135M-Instruct"
    same = TargetInfo(("LlamaForCausalLM",), "llama", 128256, 8192, source=cached)
    assert spec.verifier_mismatch(same) is None
    other = TargetInfo(("Qwen3ForCausalLM",), "qwen3", 151936, 8192, source="/m/Qwen3-8B/config.json")
    assert "architectures" in spec.verifier_mismatch(other) and "'Qwen3-8B'" in spec.verifier_mismatch(other)


def test_a_head_that_reads_other_target_layers_must_say_how():
    """The first pass's hidden input defaults to the target's final state; a head that declares it
    does not read that state is refused when it is made, not in the middle of a request."""
    from sonar_core.spec_decode.chain_proposer import ChainDraftHead

    class Final(ChainDraftHead):
        target_final_hidden = True

        def forward(self, *args):
            raise AssertionError("not run")

        def compute_logits(self, out):
            raise AssertionError("not run")

    class Layers(Final):
        target_final_hidden = False
        target_hidden_layers = (1, 2)

    class LayersWithInput(Layers):
        def target_input(self, target, rows):
            return target.layers[1].index_select(0, rows)

    Final()
    LayersWithInput()
    with pytest.raises(TypeError, match="must define target_input"):
        Layers()
