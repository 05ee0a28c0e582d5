"""The EAGLE-3 head that ships for the embedded default target: a bundle (int8 weights, the draft
vocabulary instead of the LM head) unpacks into a speculators head that loads and stays lossless;
``model`` may then be omitted for that target, and only for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from sonar_eagle.bundled import DEFAULT_BUNDLE, Bundle, bundle_for_target, pack, unpack, unpacked_head

from sonar_core.config import target_info_for, validate_speculative_config
from sonar_core.errors import ConfigError
from sonar_core.model_files import default_model_path
from sonar_core.models.gguf import SOURCE_RECORD
from sonar_core.plugins import get_plugin_manager
from sonar_core.testing.eagle_heads import build_eagle_head
from sonar_core.testing.losslessness import greedy_outputs


@pytest.fixture(scope="module")
def manager():
    return get_plugin_manager(environ={"SONAR_PLUGINS": "eagle"})


@pytest.fixture(scope="module")
def head(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random speculators head whose LM head is the target's rows of its draft vocabulary, as
    ``aphrodite train-draft`` trains it."""
    folder = build_eagle_head(target, tmp_path_factory.mktemp("bundled") / "head", draft_vocab_size=128, fc_norm=True)
    tensors = load_file(folder / "model.safetensors")
    ids = torch.arange(128) + tensors["d2t"]
    tensors["lm_head.weight"] = load_file(target / "model.safetensors")["lm_head.weight"][ids].clone()
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


def test_a_bundle_unpacks_into_the_head_it_was_made_of(head, target, tmp_path):
    bundle = Bundle.read(pack(head, tmp_path / "head.safetensors", target, "tiny"))
    assert (bundle.target, bundle.trained_depth, bundle.vocab_size) == ("tiny", 3, 512)
    original = load_file(head / "model.safetensors")
    unpacked_dir = unpack(bundle, target, tmp_path / "unpacked")
    unpacked = load_file(unpacked_dir / "model.safetensors")
    assert unpacked.keys() == original.keys()
    assert json.loads((unpacked_dir / "config.json").read_text()) == json.loads((head / "config.json").read_text())
    for name in ("lm_head.weight", "d2t", "t2d"):
        assert torch.equal(unpacked[name], original[name]), name
    for name, tensor in original.items():
        if tensor.dim() == 2 and name != "lm_head.weight":
            # int8 with one scale per row: within half a step of that row's scale.
            step = tensor.abs().amax(dim=1, keepdim=True) / 127
            assert ((unpacked[name] - tensor).abs() <= 0.5 * step + 1e-6).all(), name
        elif tensor.dim() == 1 and name not in ("d2t", "t2d"):
            assert torch.equal(unpacked[name], tensor), name


def test_an_unpacked_head_loads_and_keeps_greedy_output(head, target, tmp_path, monkeypatch):
    monkeypatch.setenv("SONAR_CACHE_DIR", str(tmp_path / "cache"))
    bundle = Bundle.read(pack(head, tmp_path / "head.safetensors", target, "tiny"))
    folder = unpacked_head(bundle, target)
    assert folder.is_relative_to(tmp_path / "cache") and unpacked_head(bundle, target) == folder  # cached
    prompts = [[5, 9, 12, 40], [100, 3], [7] * 12]
    plain, _ = greedy_outputs(target, prompts)
    tokens, llm = greedy_outputs(target, prompts, {"method": "eagle3", "model": str(folder), "num_speculative_tokens": 3})
    assert tokens == plain and llm.get_spec_decode_metrics().num_draft_tokens > 0


def test_a_head_whose_lm_head_is_not_the_targets_is_not_bundled(target, tmp_path):
    folder = build_eagle_head(target, tmp_path / "random", draft_vocab_size=128)
    with pytest.raises(ValueError, match="not the target's rows"):
        pack(folder, tmp_path / "head.safetensors", target, "tiny")


def test_without_model_another_target_is_told_how_to_get_a_head(target, manager):
    with pytest.raises(ConfigError, match="aphrodite train-draft MODEL --method eagle3") as error:
        validate_speculative_config({"method": "eagle3", "num_speculative_tokens": 3}, target_info_for(str(target)),
                                    manager, log_warnings=False)
    assert "only for the embedded default target" in str(error.value)
    assert bundle_for_target(target) is None


def test_the_embedded_default_target_has_its_head(tmp_path, manager):
    gguf = default_model_path()
    bundle = bundle_for_target(gguf)
    assert bundle is not None and bundle.path == DEFAULT_BUNDLE
    assert DEFAULT_BUNDLE.stat().st_size < 6_000_000  # small enough to ship in the package (5.1 MB)
    # The folder Sonar converts the GGUF file into names it, and finds the same head.
    (tmp_path / SOURCE_RECORD).write_text(json.dumps({"path": str(gguf)}))
    assert bundle_for_target(tmp_path) == bundle
    resolved = validate_speculative_config({"method": "eagle3"}, target_info_for(None), manager, log_warnings=False)
    assert resolved.num_speculative_tokens == bundle.trained_depth
    assert resolved.warnings == ()


@pytest.mark.slow
def test_the_default_target_drafts_with_its_head_and_stays_lossless():
    from aphrodite import LLM, SamplingParams

    prompts = ["Give me three tips for a first camping trip.", "Explain recursion to a child."]
    params = SamplingParams(temperature=0.0, max_tokens=48)
    # float32: in bfloat16 (what dtype auto picks on CPUs with AVX512-BF16) a verification step
    # rounds apart from one-token steps (on AMX CPUs its 5+ rows run on the tiles), so a near-tie
    # may go the other way, the normal numerical difference of speculative decoding.
    plain = LLM(dtype="float32").chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    llm = LLM(dtype="float32", speculative_config={"method": "eagle3", "num_speculative_tokens": 3})
    drafted = llm.chat([[{"role": "user", "content": p}] for p in prompts], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in drafted] == [o.outputs[0].token_ids for o in plain]
    # A random head accepts nothing (1.0); the shipped head accepts 2.07 at 3 drafts on the bench's
    # chat prompts (docs/performance.md).
    assert llm.get_spec_decode_metrics().mean_acceptance_length > 1.3
