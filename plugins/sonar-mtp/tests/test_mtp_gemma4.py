"""MTP with a Gemma 4 assistant checkpoint (``model`` names it): every step's drafts equal
transformers' assistant forward over the committed context (``Gemma4AssistantForCausalLM`` reading
the target's shared KV, as ``generate(assistant_model=...)`` runs it), with and without the
centroid-masked LM head, past the sliding window; greedy output stays plain output; the assistant
form's startup checks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from aphrodite import LLM
from sonar_core.errors import ConfigError
from sonar_core.testing.checkpoints import build_tiny_checkpoint
from sonar_core.testing.losslessness import greedy_outputs, random_prompts
from sonar_core.testing.mtp_layers import build_gemma4_assistant, build_mimo_target
from sonar_core.testing.plugin_checks import check_drafts, validate_for_target

DEPTH = 3


def _prompts(count: int = 6) -> list[list[int]]:
    return random_prompts(count, seed=9, vocab=500, max_len=30)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Four layers, the last full attention, a window of 8 positions (shorter than most prompts).
    return build_tiny_checkpoint(tmp_path_factory.mktemp("gemma4-target"), arch="gemma4_text", num_layers=4)


@pytest.fixture(scope="module")
def assistants(target: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gemma4-assistants")
    return {
        "plain-head": build_gemma4_assistant(target, root / "plain"),
        "ordered-embeddings": build_gemma4_assistant(target, root / "ordered", ordered_embeddings=True, seed=1),
    }


class TransformersAssistant:
    """transformers' target and assistant: the target over the committed tokens (all but the
    newest) gives the shared KV and the last hidden state; the assistant drafts from the newest
    token's position."""

    def __init__(self, target: Path, assistant: Path) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.models.gemma4_assistant import Gemma4AssistantForCausalLM

        self.main = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
        self.assistant = Gemma4AssistantForCausalLM.from_pretrained(assistant, dtype=torch.float32).eval()

    @torch.no_grad()
    def drafts(self, token_ids: list[int], depth: int) -> list[int]:
        out = self.main(torch.tensor([token_ids[:-1]]), output_hidden_states=True, return_shared_kv_states=True)
        hidden, shared = out.hidden_states[-1][:, -1:], out.shared_kv_states
        last, position = torch.tensor([[token_ids[-1]]]), torch.tensor([[len(token_ids) - 1]])
        drafts = []
        for _ in range(depth):
            embeds = torch.cat((self.main.get_input_embeddings()(last), hidden), dim=-1)
            step = self.assistant(inputs_embeds=embeds, position_ids=position, shared_kv_states=shared, use_cache=False)
            last, hidden = step.logits.argmax(dim=-1), step.last_hidden_state
            drafts.append(int(last))
        return drafts


def _config(assistant: Path, depth: int = DEPTH) -> dict:
    return {"method": "mtp", "model": str(assistant), "num_speculative_tokens": depth, "draft_stop_confidence": 0}


@pytest.mark.parametrize("name", ["plain-head", "ordered-embeddings"])
def test_drafts_equal_the_transformers_assistant_forward(name, target, assistants):
    llm = LLM(model=str(target), dtype="float32", device="cpu", speculative_config=_config(assistants[name]),
              max_num_batched_tokens=16, max_num_seqs=4)
    oracle = TransformersAssistant(target, assistants[name])
    assert check_drafts(llm, _prompts(), lambda batch, request: oracle.drafts(request.token_ids, request.max_draft_tokens)) > 10


def test_greedy_output_equals_plain_output(target, assistants):
    reference = greedy_outputs(target, _prompts(8), max_num_seqs=8)[0]
    tokens, llm = greedy_outputs(target, _prompts(8), _config(assistants["ordered-embeddings"]), max_num_seqs=8)
    assert tokens == reference
    assert llm.get_spec_decode_metrics().num_draft_tokens > 0
    probabilistic = {**_config(assistants["plain-head"]), "draft_sample_method": "probabilistic"}
    assert greedy_outputs(target, _prompts(8), probabilistic, max_num_seqs=3, max_num_batched_tokens=8)[0] == reference


def test_an_assistant_stops_where_it_runs_out_of_probability(target, assistants):
    """draft_stop_confidence 1: a random assistant is never certain, so every request keeps its
    first draft only; the output is the plain one."""
    reference = greedy_outputs(target, _prompts(8), max_num_seqs=8)[0]
    config = {**_config(assistants["plain-head"]), "draft_stop_confidence": 1.0}
    tokens, llm = greedy_outputs(target, _prompts(8), config, max_num_seqs=8)
    assert tokens == reference
    metrics = llm.get_spec_decode_metrics()
    assert metrics.num_draft_tokens == metrics.num_drafts > 0


def test_a_gemma4_target_needs_its_assistant(target):
    with pytest.raises(ConfigError) as info:
        validate_for_target(target, "mtp", method="mtp", num_speculative_tokens=2)
    assert info.value.field == "speculative_config.model"
    assert "separate assistant checkpoint" in info.value.message and "gemma-4-E4B-it-assistant" in info.value.fix


def test_an_assistant_of_another_target_is_refused(target, tmp_path):
    other = build_tiny_checkpoint(tmp_path / "other", arch="gemma4_text", num_layers=2, hidden_size=96, head_dim=24)
    with pytest.raises(ConfigError) as info:
        validate_for_target(target, "mtp", **_config(build_gemma4_assistant(other, tmp_path / "a")))
    assert "is not an assistant of this target" in info.value.message
    assert "backbone_hidden_size 96" in info.value.message


def test_model_never_makes_mtp_a_draft_model(target, tmp_path):
    qwen2 = build_tiny_checkpoint(tmp_path / "qwen2", arch="qwen2", num_layers=1)
    with pytest.raises(ConfigError) as info:
        # With sonar-draft-model installed too, the error names the method that takes such a model.
        validate_for_target(target, "mtp,draft_model", **_config(qwen2))
    assert info.value.field == "speculative_config.model"
    assert "Gemma4AssistantForCausalLM" in info.value.message
    assert '"method": "draft_model"' in str(info.value)


def test_an_assistant_is_refused_for_targets_that_carry_their_layers(assistants, tmp_path):
    mimo = build_mimo_target(build_tiny_checkpoint(tmp_path / "q", arch="qwen2", num_layers=2), tmp_path / "mimo")
    with pytest.raises(ConfigError) as info:
        validate_for_target(mimo, "mtp", **_config(assistants["plain-head"]))
    assert "carries its MTP layers in its own checkpoint" in info.value.message
