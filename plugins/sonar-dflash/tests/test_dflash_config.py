"""DFlash's rules: every bad drafter or configuration is one clear error at check time."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import pytest

from sonar_core import attention_backends
from sonar_core.attention_backends import AttentionBackend
from sonar_core.errors import ConfigError
from sonar_core.testing.block_drafters import build_block_drafter
from sonar_core.testing.checkpoints import build_tiny_checkpoint
from sonar_core.testing.losslessness import greedy_outputs
from sonar_core.testing.plugin_checks import validate_for_target


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("dflash-target"), arch="qwen3", num_layers=4, head_dim=32)


@pytest.fixture(scope="module")
def drafter(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_block_drafter(target, tmp_path_factory.mktemp("dflash") / "d", layout="zlab", block_size=5)


def _check(target: Path, **fields):
    return validate_for_target(target, "dflash", method="dflash", **fields)


def _edited_config(drafter: Path, tmp_path: Path, edit) -> Path:
    folder = tmp_path / "edited"
    shutil.copytree(drafter, folder)
    config = json.loads((folder / "config.json").read_text())
    edit(config)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_the_draft_config_decides_and_the_depth_defaults_to_the_block(target, drafter):
    resolved = _check(target, model=str(drafter))
    assert resolved.num_speculative_tokens == 4  # bonus-anchored block of 5
    assert validate_for_target(target, "dflash", model=str(drafter)).method == "dflash"  # DFlashDraftModel


def test_more_drafts_than_a_block_makes_warns(target, drafter):
    resolved = _check(target, model=str(drafter), num_speculative_tokens=16)
    assert any("drafts 4 tokens per block of 5" in w for w in resolved.warnings)


def test_parallel_drafting_may_not_be_set(target, drafter):
    with pytest.raises(ConfigError) as info:
        _check(target, model=str(drafter), parallel_drafting=True)
    assert info.value.field == "speculative_config.parallel_drafting"
    assert "selects parallel drafting automatically" in info.value.message and "do not set" in info.value.fix


def test_a_backend_without_non_causal_attention_is_refused(target, drafter, monkeypatch):
    causal_only = AttentionBackend("CAUSAL_ONLY", non_causal=False, description="a causal-only test backend")
    monkeypatch.setitem(attention_backends.BACKENDS, "CAUSAL_ONLY", causal_only)
    with pytest.raises(ConfigError) as info:
        _check(target, model=str(drafter), attention_backend="causal_only")
    assert "non-causal attention is unsupported" in info.value.message
    assert "set a compatible draft attention backend: TORCH_SDPA, FLASH_ATTN" in info.value.fix
    # A causal drafter does not need it.
    causal = build_block_drafter(target, drafter.parent / "causal", layout="zlab", block_size=5, causal=True)
    assert _check(target, model=str(causal), attention_backend="CAUSAL_ONLY").method == "dflash"


def test_an_unknown_backend_names_the_known_ones(target, drafter):
    with pytest.raises(ConfigError) as info:
        _check(target, model=str(drafter), attention_backend="TRITON_ATTN")
    assert info.value.field == "speculative_config.attention_backend"
    assert "TORCH_SDPA" in info.value.fix and "FLASH_ATTN" in info.value.fix


def test_flash_attn_on_the_cpu_says_what_runs_instead(target, drafter, caplog):
    config = {"method": "dflash", "model": str(drafter), "num_speculative_tokens": 2, "attention_backend": "FLASH_ATTN"}
    with caplog.at_level(logging.WARNING, logger="sonar.engine"):
        greedy_outputs(target, [[5, 6, 7]], config, max_tokens=4)
    assert "attention_backend FLASH_ATTN has no kernel on cpu; the draft runs TORCH_SDPA instead" in caplog.text


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c["dflash_config"].update(mask_token_id=9999), "mask_token_id 9999 is outside the target vocabulary"),
        (lambda c: c["dflash_config"].pop("mask_token_id"), "names no mask_token_id"),
        (lambda c: c["dflash_config"].update(target_layer_ids=[0, 7]), r"\[8\], outside the target's 0..4"),
        (lambda c: c.update(layer_types=["sliding_attention"]), "only full-attention draft layers are supported"),
        (lambda c: c.update(markov_rank=8, markov_head_type="vanilla"), 'use "method": "dspark"'),
    ],
    ids=["mask-outside", "no-mask", "layers-outside", "sliding", "dspark-checkpoint"],
)
def test_bad_drafters_are_named(target, drafter, tmp_path, edit, message):
    with pytest.raises(ConfigError, match=message):
        _check(target, model=str(_edited_config(drafter, tmp_path, edit)))


def test_a_dspark_checkpoint_of_rank_0_drafts_as_dflash_from_the_anchor(target, tmp_path):
    block7 = build_block_drafter(target, tmp_path / "block7", layout="deepspec", block_size=7)
    assert _check(target, model=str(block7)).num_speculative_tokens == 7  # anchored: every slot drafts


def test_the_drafts_context_limit_stops_speculation_on_long_requests(target, drafter, tmp_path):
    short = _edited_config(drafter, tmp_path, lambda c: c.update(max_position_embeddings=24))
    resolved = _check(target, model=str(short))
    assert resolved.draft_max_model_len == 24
    tokens, llm = greedy_outputs(target, [list(range(3, 30))], {"method": "dflash", "model": str(short),
                                                                 "num_speculative_tokens": 4}, max_tokens=8)
    assert llm.get_spec_decode_metrics().num_drafts == 0  # 27 prompt tokens: past the draft's 24
    assert tokens == greedy_outputs(target, [list(range(3, 30))], max_tokens=8)[0]


def test_dflash_needs_a_drafter(target):
    with pytest.raises(ConfigError, match="drafts with a trained DFlash block drafter, and none was given"):
        _check(target, num_speculative_tokens=3)
