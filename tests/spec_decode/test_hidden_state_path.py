"""The hidden-state path: every position the target runs reaches the proposer exactly once, with the
target's states, whatever the chunking, the drafts and their rejection; block drafters' slots are
reserved; the final post-norm state is the LM head's input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from sonar_core.config import EngineConfig
from sonar_core.engine.llm_engine import LLMEngine
from sonar_core.plugins import MethodSpec, PluginSource, get_plugin_manager, hookimpl
from sonar_core.sampling_params import SamplingParams
from sonar_core.spec_decode.proposer import DraftProposal, ProposeBatch, Proposer, ProposerCapabilities
from sonar_core.testing.checkpoints import build_tiny_checkpoint

LAYERS = 3
STATES = (LAYERS, 0, 2)  # in the order asked for: columns follow it


class ProbeProposer(Proposer):
    """Records every row it is handed. Drafts the target's own continuation (from a plain run)
    with its last draft spoilt, so that drafts are both accepted and rejected."""

    def __init__(self, block_len: int = 0, continuations: list[list[int]] = ()) -> None:
        self.continuations = list(continuations)
        self.capabilities = ProposerCapabilities(
            target_hidden_layers=STATES, target_final_hidden=True, draft_block_len=block_len
        )
        self.rows: dict[str, dict[int, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.deliveries: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self.coverage: list[tuple[int, int]] = []  # (positions the block table covers, needed)
        self.block_size = 0

    def add_request(self, request_id: str, prompt_token_ids: list[int]) -> None:
        self.rows[request_id] = {}
        self.deliveries[request_id] = []

    def propose(self, batch: ProposeBatch) -> DraftProposal:
        hidden = batch.target_hidden
        assert hidden.layers == STATES
        self.block_size = batch.block_size
        drafts = []
        for request in batch.requests:
            for offset, row in enumerate(range(request.hidden_rows.start, request.hidden_rows.stop)):
                position = request.hidden_start + offset
                self.deliveries[request.request_id].append(position)
                self.rows[request.request_id][position] = (hidden.aux[row].clone(), hidden.final[row].clone())
            if request.is_finished:
                self.finished.add(request.request_id)
            if request.max_draft_tokens:
                needed = len(request.token_ids) + max(request.max_draft_tokens, self.capabilities.draft_block_len - 1)
                self.coverage.append((len(request.block_table) * batch.block_size, needed))
            drafts.append(self._drafts(request.token_ids, request.max_draft_tokens))
        return DraftProposal(drafts)

    def _drafts(self, token_ids: list[int], count: int) -> list[int]:
        known = next((c for c in self.continuations if c[: len(token_ids)] == token_ids), None)
        if known is None or count == 0:
            return [token_ids[-1]] * count
        drafts = known[len(token_ids) : len(token_ids) + count]
        drafts += [token_ids[-1]] * (count - len(drafts))
        drafts[-1] = (drafts[-1] + 1) % 512
        return drafts


class ProbePlugin:
    def __init__(self, proposer: ProbeProposer) -> None:
        self.proposer = proposer

    @hookimpl
    def sonar_register_methods(self, registry):
        registry.register(MethodSpec("probe", lambda context, weights: self.proposer))


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("probe-target"), arch="llama", num_layers=LAYERS)


def _run(
    target: Path, proposer: ProbeProposer | None, prompts, **engine_fields
) -> tuple[LLMEngine, dict[str, list[int]]]:
    """Generate greedily (with the probe as proposer, or without speculation); full sequences."""
    manager = get_plugin_manager(load_entry_points=False, plugins=[(ProbePlugin(proposer), PluginSource("probe", "", ""))])
    speculative = {"method": "probe", "num_speculative_tokens": 3} if proposer is not None else None
    config = EngineConfig(
        model=str(target), dtype="float32", device="cpu", speculative_config=speculative, **engine_fields
    )
    engine = LLMEngine(config, manager)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                tokens[out.request_id] = out.prompt_token_ids + out.outputs[0].token_ids
    return engine, {i: tokens[i] for i in ids}


PROMPTS = [[5, 9, 12, 40, 7] * 5, [100, 3], list(range(20, 50)), [8] * 9]


@pytest.mark.parametrize("engine_fields", [{}, {"max_num_batched_tokens": 8, "max_num_seqs": 4}],
                         ids=["whole-prefill", "chunked-prefill"])
def test_every_position_arrives_once_with_the_targets_states(target, engine_fields):
    from transformers import AutoModelForCausalLM

    _, plain = _run(target, None, PROMPTS)
    proposer = ProbeProposer(continuations=list(plain.values()))
    engine, tokens = _run(target, proposer, PROMPTS, **engine_fields)
    assert tokens == plain
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for request_id, sequence in tokens.items():
        # Every position the target read, once each and in order; the last token was never read.
        assert proposer.deliveries[request_id] == list(range(len(sequence) - 1))
        assert request_id in proposer.finished
        with torch.no_grad():
            states = hf(torch.tensor([sequence[:-1]]), output_hidden_states=True).hidden_states
        rows = proposer.rows[request_id]
        aux = torch.stack([rows[p][0] for p in range(len(sequence) - 1)])
        final = torch.stack([rows[p][1] for p in range(len(sequence) - 1)])
        hidden = 64
        for column, layer in enumerate(STATES):
            got = aux[:, column * hidden : (column + 1) * hidden]
            if layer == LAYERS:  # transformers' last entry is the normed state
                got = engine.model.model.norm(got)
            torch.testing.assert_close(got, states[layer][0], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(final, states[LAYERS][0], rtol=1e-4, atol=1e-4)
    summary = engine.spec_stats.summary()
    assert summary.num_draft_tokens > summary.num_accepted_tokens > 0  # some drafts kept, some rejected


def test_block_drafters_keep_their_whole_block_allocated(target):
    proposer = ProbeProposer(block_len=9)
    engine, _ = _run(target, proposer, PROMPTS)
    assert proposer.coverage
    assert all(covered >= needed for covered, needed in proposer.coverage)
    # The block (9 slots from the newest token) is longer than any draft budget (3 drafts).
    assert any(needed > 0 for _, needed in proposer.coverage)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
