"""Probabilistic EAGLE drafting follows the target distribution (statistically), and a head whose
draft distribution equals the target's is accepted at every position.

Both use a target whose next-token distribution is the same at every position: every token embeds
to one vector and every layer adds nothing (zero ``o_proj`` and ``down_proj``), so the residual
stream is that vector everywhere. An EAGLE-3 head that reads the last state through an identity
``fc``, adds nothing in its layer, and scores with the target's final norm and LM head drafts from
exactly the target's distribution; perturbing its LM head makes it a different, overlapping one.
Sampled outputs are then i.i.d. draws of a known distribution, which makes a distribution-free
check possible (the bound of tests/spec_decode/test_rejection_sampler.py: a correct engine fails
it with probability at most 1e-6).
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from aphrodite import LLM, SamplingParams
from sonar_core.sample.processing import SamplingBatch, processed_probs
from sonar_core.testing.eagle_heads import build_eagle_head

TOP_K = 4
DELTA = 1e-6


def _l1_bound(samples: int, categories: int) -> float:
    return math.sqrt(2.0 * (math.log(2.0**categories - 2.0) - math.log(DELTA)) / samples)


@pytest.fixture(scope="module")
def constant_target(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("constant-target")
    for item in target.iterdir():
        shutil.copy2(item, folder / item.name)
    tensors = load_file(target / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    tensors["model.embed_tokens.weight"] = embed[7].expand_as(embed).clone()
    for name in tensors:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            tensors[name] = torch.zeros_like(tensors[name])
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


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


def _target_distribution(llm: LLM, params: SamplingParams) -> torch.Tensor:
    engine = llm.engine
    hidden = engine.model.model.norm(engine.model.model.embed_tokens.weight[:1])
    logits = engine.model.compute_logits(hidden)
    return processed_probs(logits, SamplingBatch.from_params([params], [None], "cpu"))[0].double()


def _llm(target: Path, head: Path, depth: int) -> LLM:
    return LLM(
        model=str(target), dtype="float32", device="cpu", max_num_seqs=256,
        speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": depth,
                            "draft_sample_method": "probabilistic"},
    )


def test_a_head_drafting_the_targets_distribution_is_always_accepted(constant_target, tmp_path):
    head = _matching_head(constant_target, tmp_path / "head", lm_head_noise=0.0)
    llm = _llm(constant_target, head, depth=4)
    params = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=1 + 5 * 5, ignore_eos=True, seed=3)
    llm.generate([[5, 9, 12], [40, 41], [100]], params, use_tqdm=False)
    summary = llm.get_spec_decode_metrics()
    assert summary.num_drafts > 0
    assert summary.per_position_acceptance_rate == [1.0] * 4


def _checks(llm: LLM, samples: int = 3000) -> dict[str, tuple[float, float]]:
    """Sample ``samples`` requests of four tokens; L1 distance and bound of each checked distribution."""
    params = SamplingParams(temperature=1.0, top_k=TOP_K, max_tokens=4, ignore_eos=True)
    p = _target_distribution(llm, params)
    support = torch.nonzero(p).squeeze(1)
    assert len(support) == TOP_K
    outputs = llm.generate([[3 + i % 50] for i in range(samples)], params, use_tqdm=False)
    index = {int(token): i for i, token in enumerate(support)}
    local = torch.tensor([[index[t] for t in o.outputs[0].token_ids] for o in outputs])
    expected = p[support]
    results = {}
    # Each position's token (drafted, recovered or bonus) is distributed as p ...
    for position in range(1, 4):
        empirical = torch.bincount(local[:, position], minlength=TOP_K).double() / samples
        results[f"position {position}"] = (float((empirical - expected).abs().sum()), _l1_bound(samples, TOP_K))
    # ... and consecutive tokens of one verification step are independent draws.
    joint = torch.bincount(local[:, 1] * TOP_K + local[:, 2], minlength=TOP_K * TOP_K).double() / samples
    results["positions 1-2"] = (
        float((joint - torch.outer(expected, expected).flatten()).abs().sum()),
        _l1_bound(samples, TOP_K * TOP_K),
    )
    return results


def test_sampled_output_follows_the_target_distribution(constant_target, tmp_path):
    head = _matching_head(constant_target, tmp_path / "head", lm_head_noise=0.05)
    llm = _llm(constant_target, head, depth=2)
    results = _checks(llm)
    summary = llm.get_spec_decode_metrics()
    # Drafts came from a different but overlapping distribution: about half were accepted.
    assert 0.2 < summary.acceptance_rate < 0.8
    for name, (distance, bound) in results.items():
        assert distance < bound, f"{name}: L1 {distance:.4f} >= bound {bound:.4f}"


def test_the_check_catches_probabilities_in_the_wrong_vocabulary_slots(constant_target, tmp_path, monkeypatch):
    """Power: draft probabilities scattered one token off (a vocabulary-map error) bias the output
    beyond the bound, so the check above fails on such an engine."""
    from sonar_core.spec_decode import draft_sampling

    sample = draft_sampling.DraftSampler.sample

    def shifted(self, logits, batch):
        drawn = sample(self, logits, batch)
        return draft_sampling.DraftSample(drawn.token_ids, drawn.probs.roll(1, dims=-1))

    monkeypatch.setattr(draft_sampling.DraftSampler, "sample", shifted)
    head = _matching_head(constant_target, tmp_path / "head", lm_head_noise=0.05)
    results = _checks(_llm(constant_target, head, depth=2))
    assert any(distance > bound for distance, bound in results.values())
