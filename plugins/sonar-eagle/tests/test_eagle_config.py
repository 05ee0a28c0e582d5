"""Every bad EAGLE checkpoint or configuration is one clear error (or warning) at check time,
naming the file or field and the fix, before any weight is loaded."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sonar_core.config import target_info_for, validate_speculative_config
from sonar_core.entrypoints.cli import main
from sonar_core.errors import ConfigError
from sonar_core.plugins import get_plugin_manager
from sonar_core.testing.eagle_heads import build_eagle_head


@pytest.fixture(scope="module")
def manager():
    return get_plugin_manager(environ={"SONAR_PLUGINS": "eagle"})


def _check(target: Path, manager, **fields):
    config = {"num_speculative_tokens": 3, **fields}
    return validate_speculative_config(config, target_info_for(str(target)), manager, log_warnings=False)


def _edited(head: Path, tmp_path: Path, *, tensors=None, config=None) -> Path:
    """A copy of ``head`` with its tensors and/or config.json changed by the given functions."""
    folder = tmp_path / "edited"
    shutil.copytree(head, folder)
    if tensors is not None:
        weights = load_file(folder / "model.safetensors")
        tensors(weights)
        save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    if config is not None:
        data = json.loads((folder / "config.json").read_text())
        config(data)
        (folder / "config.json").write_text(json.dumps(data))
    return folder


@pytest.fixture(scope="module")
def speculators_head(target, make_head) -> Path:
    return make_head(target, method="eagle3", layout="speculators", draft_vocab_size=128)


def test_a_valid_head_passes_and_takes_its_trained_depth(target, speculators_head, manager):
    resolved = validate_speculative_config(
        {"method": "eagle3", "model": str(speculators_head)}, target_info_for(str(target)), manager, log_warnings=False
    )
    assert resolved.num_speculative_tokens == 3  # speculators_config.proposal_methods[0].speculative_tokens
    assert resolved.warnings == ()


def test_a_speculators_head_is_detected_without_a_method(target, speculators_head, manager):
    resolved = _check(target, manager, model=str(speculators_head))
    assert resolved.method == "eagle3"
    assert any("speculators_model_type 'eagle3'" in w for w in resolved.warnings)


def test_a_missing_tensor_is_named(target, speculators_head, manager, tmp_path):
    head = _edited(speculators_head, tmp_path, tensors=lambda w: w.pop("layers.0.mlp.down_proj.weight"))
    with pytest.raises(ConfigError) as info:
        _check(target, manager, method="eagle3", model=str(head))
    assert info.value.field == "speculative_config.model"
    assert "missing (1): layers.0.mlp.down_proj.weight" in info.value.message
    assert str(head) in info.value.message
    assert "published layout" in info.value.fix


def test_unexpected_and_misshapen_tensors_are_named_together(target, speculators_head, manager, tmp_path):
    def edit(weights):
        weights["extra.bias"] = torch.zeros(3)
        weights["norm.weight"] = torch.ones(5)

    head = _edited(speculators_head, tmp_path, tensors=edit)
    with pytest.raises(ConfigError) as info:
        _check(target, manager, method="eagle3", model=str(head))
    assert "unexpected (1): extra.bias" in info.value.message
    assert "of the wrong shape (1): norm.weight [5] (expected [64])" in info.value.message


def test_a_head_of_another_hidden_size_is_refused(checkpoints, target, manager, tmp_path):
    wider = checkpoints.get("llama", num_layers=8, hidden_size=96, num_heads=4)
    head = build_eagle_head(wider, tmp_path / "wide", method="eagle3", layout="speculators")
    with pytest.raises(ConfigError) as info:
        _check(target, manager, method="eagle3", model=str(head))
    assert "hidden states of size 96, but the target's hidden size is 64" in info.value.message


def test_aux_layers_outside_the_target_are_refused(target, make_head, manager):
    head = make_head(target, method="eagle3", layout="speculators", aux_layers=[2, 4, 9])
    with pytest.raises(ConfigError) as info:
        _check(target, manager, method="eagle3", model=str(head))
    assert "[9], outside the target's 0..8" in info.value.message


def test_fc_width_must_match_the_aux_layers(target, speculators_head, manager, tmp_path):
    head = _edited(speculators_head, tmp_path, config=lambda c: c.update(eagle_aux_hidden_state_layer_ids=[2, 4]))
    with pytest.raises(ConfigError) as info:
        _check(target, manager, method="eagle3", model=str(head))
    assert "fc.weight reads 192 values, not 2 target states of 64" in info.value.message


@pytest.mark.parametrize(
    ("edit", "expected"),
    [
        (lambda c: c.update(draft_vocab_size=100), "d2t has shape [128], but draft_vocab_size is 100"),
        (lambda c: c.update(draft_vocab_size=512), "d2t has shape [128], but draft_vocab_size is 512"),
    ],
    ids=["d2t-longer", "full-size-with-reduced-head"],
)
def test_vocabulary_maps_must_fit_draft_vocab_size(target, speculators_head, manager, tmp_path, edit, expected):
    head = _edited(speculators_head, tmp_path, config=edit)
    with pytest.raises(ConfigError) as info:
        _check(target, manager, method="eagle3", model=str(head))
    assert expected in info.value.message


def test_t2d_must_cover_the_target_vocabulary(target, speculators_head, manager, tmp_path):
    head = _edited(speculators_head, tmp_path, tensors=lambda w: w.update(t2d=w["t2d"][:300]))
    with pytest.raises(ConfigError, match=r"t2d has shape \[300\], but the target vocabulary has 512 tokens"):
        _check(target, manager, method="eagle3", model=str(head))


def test_d2t_values_are_checked_when_the_head_loads(target, speculators_head, tmp_path):
    from aphrodite import LLM

    head = _edited(speculators_head, tmp_path, tensors=lambda w: w.update(d2t=torch.zeros_like(w["d2t"])))
    with pytest.raises(ConfigError, match="d2t does not map draft ids to increasing target ids|t2d marks"):
        LLM(model=str(target), dtype="float32", device="cpu",
            speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": 2})


def test_a_head_for_another_verifier_warns(target, make_head, manager):
    head = make_head(target, method="eagle3", layout="speculators", verifier="meta-llama/Llama-3.1-8B-Instruct")
    resolved = _check(target, manager, method="eagle3", model=str(head))
    (warning,) = resolved.warnings
    assert "'meta-llama/Llama-3.1-8B-Instruct'" in warning and "Similar names do not establish compatibility" in warning


def test_more_drafts_than_the_head_was_trained_for_warns(target, make_head, manager):
    head = make_head(target, method="eagle3", layout="speculators", trained_depth=2)
    resolved = _check(target, manager, method="eagle3", model=str(head), num_speculative_tokens=5)
    assert any("more than the 2 draft tokens" in w for w in resolved.warnings)


@pytest.mark.parametrize(
    ("method", "head_options", "expected"),
    [
        ("eagle", dict(method="eagle3", layout="safeailab"), 'a draft for method .eagle3.: use "method": "eagle3"'),
        ("eagle3", dict(method="eagle", layout="safeailab"), 'is an EAGLE-1 head.*"method": "eagle"'),
    ],
)
def test_a_head_of_the_other_generation_names_the_right_method(target, make_head, manager, method, head_options, expected):
    head = make_head(target, **head_options)
    with pytest.raises(ConfigError, match=expected):
        _check(target, manager, method=method, model=str(head))


def test_a_method_without_a_head_says_what_to_pass(target, manager):
    with pytest.raises(ConfigError) as info:
        _check(target, manager, method="eagle3")
    assert info.value.field == "speculative_config.model"
    assert "trained EAGLE head" in info.value.fix and "for this target" in info.value.fix


def test_an_unsupported_draft_architecture_fails_in_check_config(target, speculators_head, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SONAR_PLUGINS", "eagle")
    head = _edited(speculators_head, tmp_path, config=lambda c: c.update(architectures=["MedusaModel"]))
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    status = main(["serve", str(target), "--speculative-config", spec, "--check-config"])
    error = capsys.readouterr().err
    assert status == 2
    assert "[MedusaModel]" in error and "architectures and model_type" in error
    assert "aphrodite plugins --models" in error


def test_check_config_accepts_a_valid_head(target, speculators_head, capsys, monkeypatch):
    monkeypatch.setenv("SONAR_PLUGINS", "eagle")
    spec = json.dumps({"method": "eagle3", "model": str(speculators_head), "num_speculative_tokens": 3})
    assert main(["serve", str(target), "--speculative-config", spec, "--check-config"]) == 0



def test_plugins_models_lists_the_eagle_draft_architectures(capsys, monkeypatch):
    monkeypatch.setenv("SONAR_PLUGINS", "eagle")
    assert main(["plugins", "--models"]) == 0
    rows = [line.split()[:3] for line in capsys.readouterr().out.splitlines()[1:]]
    assert ["eagle3", "Eagle3Speculator", "speculators"] in rows
    assert ["eagle", "LlamaForCausalLM", "SafeAILab"] in rows
    assert main(["plugins", "--models", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {"method": "eagle3", "architecture": "LlamaForCausalLMEagle3", "layout": "SafeAILab EAGLE-3",
            "notes": "midlayer.*, d2t/t2d", "distribution": "sonar-eagle"} in data["draft_architectures"]
