"""Probabilistic EAGLE drafting follows the target distribution (statistically), and a head whose
draft distribution equals the target's is accepted at every position.

Both use core's constant-distribution target (sonar_core.testing.losslessness): the residual stream
is one vector at every position, so an EAGLE-3 head that reads the last state through an identity
``fc``, adds nothing in its layer, and scores with the target's final norm and LM head drafts from
exactly the target's distribution; perturbing its LM head makes it a different, overlapping one.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from aphrodite import LLM
from sonar_core.testing.branches import branch_on_every_step
from sonar_core.testing.eagle_heads import build_eagle_head
from sonar_core.testing.losslessness import (
    assert_follows_target_distribution,
    constant_distribution_target,
    per_position_acceptance,
    probabilistic_llm,
    sampled_output_distances,
)

TOP_K = 4


@pytest.fixture(scope="module")
def constant_target(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return constant_distribution_target(target, tmp_path_factory.mktemp("constant-target"))


def _matching_head(target: Path, out: Path, lm_head_noise: float) -> Path:
    """An EAGLE-3 head that reads the target's last state and drafts from the target's head."""
    layers = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    build_eagle_head(target, out, method="eagle3", layout="speculators", aux_layers=[layers])
    head = load_file(out / "model.safetensors")
    weights = load_file(target / "model.safetensors")
    hidden = head["fc.weight"].shape[0]
    head["fc.weight"] = torch.eye(hidden)
    head["layers.0.self_attn.o_proj.weight"].zero_()
    head["layers.0.mlp.down_proj.weight"].zero_()
    head["norm.weight"] = weights["model.norm.weight"].clone()
    noise = torch.randn(weights["lm_head.weight"].shape, generator=torch.Generator().manual_seed(5))
    head["lm_head.weight"] = weights["lm_head.weight"] + lm_head_noise * noise
    save_file(head, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def _llm(target: Path, head: Path, depth: int):
    return probabilistic_llm(target, {"method": "eagle3", "model": str(head), "num_speculative_tokens": depth,
                                      "draft_stop_confidence": 0})


def test_a_head_drafting_the_targets_distribution_is_always_accepted(constant_target, tmp_path):
    head = _matching_head(constant_target, tmp_path / "head", lm_head_noise=0.0)
    assert per_position_acceptance(_llm(constant_target, head, depth=4), depth=4, top_k=TOP_K) == [1.0] * 4


def test_sampled_output_follows_the_target_distribution(constant_target, tmp_path):
    head = _matching_head(constant_target, tmp_path / "head", lm_head_noise=0.05)
    llm = _llm(constant_target, head, depth=2)
    results = sampled_output_distances(llm, top_k=TOP_K)
    summary = llm.get_spec_decode_metrics()
    # Drafts came from a different but overlapping distribution: about half were accepted.
    assert 0.2 < summary.acceptance_rate < 0.8
    assert_follows_target_distribution(results)


@pytest.mark.parametrize("draft_sample_method", ["probabilistic", "greedy"])
def test_sampled_output_with_draft_branches_follows_the_target_distribution(
    constant_target, tmp_path, draft_sample_method, monkeypatch
):
    """With branches, a request's first token is drawn from the target and picks the chain that
    starts with it: the output follows the target however the first drafts were chosen."""
    branch_on_every_step(monkeypatch)
    head = _matching_head(constant_target, tmp_path / "head", lm_head_noise=0.05)
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2, "num_draft_branches": 3,
              "draft_sample_method": draft_sample_method, "draft_stop_confidence": 0}
    llm = LLM(model=str(constant_target), dtype="float32", device="cpu", max_num_seqs=256, speculative_config=config)
    results = sampled_output_distances(llm, top_k=TOP_K)
    # Three first drafts out of the four tokens the target samples from: most first tokens match.
    assert llm.get_spec_decode_metrics().per_position_acceptance_rate[0] > 0.6
    assert_follows_target_distribution(results)


def test_the_check_catches_probabilities_in_the_wrong_vocabulary_slots(constant_target, tmp_path, monkeypatch):
    """Power: draft probabilities scattered one token off (a vocabulary-map error) bias the output
    beyond the bound, so the check above fails on such an engine."""
    from sonar_core.spec_decode import draft_sampling

    sample = draft_sampling.DraftSampler.sample

    def shifted(self, logits, batch, confidence=False):
        drawn = sample(self, logits, batch, confidence)
        return draft_sampling.DraftSample(drawn.token_ids, drawn.probs.roll(1, dims=-1), drawn.top_probabilities)

    monkeypatch.setattr(draft_sampling.DraftSampler, "sample", shifted)
    head = _matching_head(constant_target, tmp_path / "head", lm_head_noise=0.05)
    results = sampled_output_distances(_llm(constant_target, head, depth=2), top_k=TOP_K)
    assert any(distance > bound for distance, bound in results.values())
