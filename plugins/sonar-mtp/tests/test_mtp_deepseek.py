"""MTP on DeepSeek-V3 targets (``model.layers.{L}.*``): the first draft equals transformers' own MTP
forward (``transformers.modeling_layers.MtpModel``, what ``generate(use_mtp=True)`` runs), and
greedy output with MTP equals plain output (batches, depths, chunked prefill)."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from aphrodite import LLM
from sonar_core.testing.losslessness import greedy_outputs, random_prompts
from sonar_core.testing.mtp_layers import build_deepseek_target
from sonar_core.testing.plugin_checks import check_drafts, validate_for_target

LAYERS = 2


def _prompts(count: int = 6) -> list[list[int]]:
    return random_prompts(count, seed=7, vocab=250, max_len=30)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_deepseek_target(tmp_path_factory.mktemp("deepseek-mtp") / "t", num_layers=LAYERS)


class TransformersMtp:
    """transformers' DeepSeek-V3 target and its generic MTP layer, the MTP block holding the same
    weights Sonar loads from ``model.layers.{L}.*`` (copied from the saved full model's last layer,
    in transformers' in-memory layout)."""

    def __init__(self, target: Path) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.modeling_layers import MtpModel

        self.main = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        full = AutoModelForCausalLM.from_pretrained(target.with_name(target.name + "-full"), dtype=torch.float32)
        self.mtp = MtpModel(self.main, 1).eval()
        layer = self.mtp.layers[0]
        layer.mtp_block.load_state_dict(full.model.layers[LAYERS].state_dict())
        w = load_file(target / "model.safetensors")
        prefix = f"model.layers.{LAYERS}."
        for module, name in ((layer.enorm, "enorm"), (layer.hnorm, "hnorm"), (layer.eh_proj, "eh_proj"),
                             (layer.post_norm, "shared_head.norm")):
            module.weight.data.copy_(w[f"{prefix}{name}.weight"])

    @torch.no_grad()
    def first_draft(self, token_ids: list[int]) -> int:
        """The MTP prediction after ``token_ids``: row t pairs the target's final state at t with
        token t + 1, for t up to the newest token's predecessor."""
        tokens = torch.tensor([token_ids])
        states = self.main(tokens[:, :-1], output_hidden_states=True).hidden_states[-1]
        positions = torch.arange(len(token_ids) - 1)[None]
        out = self.mtp.forward_layer(0, states, positions, None, input_ids=tokens[:, 1:])
        return int(self.mtp._project_to_logits(out)[0, -1].argmax())


def test_the_first_draft_equals_transformers_mtp_forward(target):
    llm = LLM(model=str(target), dtype="float32", device="cpu", speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    oracle = TransformersMtp(target)
    assert check_drafts(llm, _prompts(), lambda batch, request: [oracle.first_draft(request.token_ids)]) > 10


def test_drafts_after_a_cached_prefix_equal_transformers_mtp_forward(target):
    """Prefix caching stays on with MTP layers: a request that starts after another one's cached
    blocks finds the draft KV it would have written, so its drafts are transformers' over the whole
    context. One request at a time, so that each finds the blocks of those before it."""
    llm = LLM(model=str(target), dtype="float32", device="cpu", block_size=4, max_num_seqs=1,
              speculative_config={"method": "mtp", "num_speculative_tokens": 1})
    assert llm.engine.prefix_caching
    rng = random.Random(3)
    prefix = [rng.randrange(3, 250) for _ in range(12)]
    # Three whole blocks in common, then other tokens: the third block's last draft KV pairs it
    # with the next token, so only two blocks are shared.
    prompts = [prefix + [50 + i] + [rng.randrange(3, 250) for _ in range(5)] for i in range(4)]
    oracle = TransformersMtp(target)
    assert check_drafts(llm, prompts, lambda batch, request: [oracle.first_draft(request.token_ids)]) > 10
    assert llm.engine.prefix_cache_hits == 3 * 8


@pytest.mark.parametrize("depth", [1, 3])
def test_greedy_output_equals_plain_output(depth, target):
    reference = greedy_outputs(target, _prompts(), max_num_seqs=6)[0]
    config = {"method": "deepseek_mtp", "num_speculative_tokens": depth}
    tokens, llm = greedy_outputs(target, _prompts(), config, max_num_seqs=6)
    assert tokens == reference
    assert llm.get_spec_decode_metrics().num_draft_tokens > 0
    assert greedy_outputs(target, _prompts(), config, max_num_seqs=3, max_num_batched_tokens=8)[0] == reference


def test_the_embedding_and_head_copies_are_not_loaded(target):
    resolved = validate_for_target(target, "mtp", method="mtp")
    assert resolved.num_speculative_tokens == 1
    llm = LLM(model=str(target), dtype="float32", device="cpu", speculative_config={"method": "mtp"})
    head = llm.engine.speculator.proposer.head
    names = {name for name, _ in head.named_parameters()}
    assert not any("embed_tokens" in name or "shared_head" in name or "lm_head" in name for name in names)
    assert head._target.lm_head is llm.engine.model.lm_head
