"""DSpark's rules and its forms: the block-size rule, embedded weights, the confidence head."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from sonar_core.errors import ConfigError
from sonar_core.testing.block_drafters import build_block_drafter
from sonar_core.testing.checkpoints import build_tiny_checkpoint
from sonar_core.testing.losslessness import greedy_outputs
from sonar_core.testing.plugin_checks import validate_for_target

PROMPTS = [[5, 9, 12, 40, 7] * 3, [100, 3, 3, 8], list(range(20, 60))]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("dspark-target"), arch="qwen3", num_layers=4, head_dim=32)


@pytest.fixture(scope="module")
def drafter(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_block_drafter(target, tmp_path_factory.mktemp("dspark") / "d", layout="deepspec", block_size=7,
                               markov_rank=8, confidence_head=True)


@pytest.fixture(scope="module")
def embedded(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_block_drafter(target, tmp_path_factory.mktemp("embedded") / "target", layout="embedded",
                               block_size=4, markov_rank=8, markov_head_type="rnn")


def _check(target: Path, **fields):
    return validate_for_target(target, "dspark", method="dspark", **fields)


def test_the_block_size_is_the_default_depth_and_a_smaller_one_is_refused(target, drafter):
    assert _check(target, model=str(drafter)).num_speculative_tokens == 7
    with pytest.raises(ConfigError) as info:
        _check(target, model=str(drafter), num_speculative_tokens=3)
    assert info.value.field == "speculative_config.num_speculative_tokens"
    assert "drafts blocks of 7" in info.value.message and "unsupported layout" in info.value.message
    assert "at least 7" in info.value.fix
    assert any("drafts 7 tokens per block" in w for w in _check(target, model=str(drafter), num_speculative_tokens=9).warnings)


def test_embedded_weights_draft_without_a_model_and_the_target_runs_without_them(embedded):
    plain, _ = greedy_outputs(embedded, PROMPTS)  # the dspark.* tensors are claimed, not the target's
    tokens, llm = greedy_outputs(embedded, PROMPTS, {"method": "dspark", "num_speculative_tokens": 4})
    assert tokens == plain
    assert llm.get_spec_decode_metrics().num_draft_tokens > 0
    assert llm.engine.speculator.proposer.head.markov_head.kind == "rnn"


def test_a_target_without_embedded_weights_needs_a_model(target):
    with pytest.raises(ConfigError) as info:
        _check(target, num_speculative_tokens=7)
    assert "embeds no DSpark weights" in info.value.message and "'dspark_config'" in info.value.message


def test_the_confidence_head_cuts_proposals(target, drafter):
    reference, _ = greedy_outputs(target, PROMPTS)
    config = {"method": "dspark", "model": str(drafter), "num_speculative_tokens": 7}
    _, full = greedy_outputs(target, PROMPTS, config)
    tokens, cut = greedy_outputs(target, PROMPTS, {**config, "confidence_threshold": 0.5})
    assert tokens == reference
    drafted = [llm.get_spec_decode_metrics() for llm in (full, cut)]
    assert drafted[1].num_draft_tokens / drafted[1].num_drafts < drafted[0].num_draft_tokens / drafted[0].num_drafts


def test_a_threshold_without_a_confidence_head_is_refused(target, tmp_path):
    plain = build_block_drafter(target, tmp_path / "d", layout="deepspec", block_size=4, markov_rank=4)
    with pytest.raises(ConfigError, match="has no confidence head"):
        _check(target, model=str(plain), confidence_threshold=0.4)


def test_a_missing_markov_tensor_and_an_unknown_head_type_are_named(target, drafter, tmp_path):
    folder = tmp_path / "d"
    shutil.copytree(drafter, folder)
    weights = load_file(folder / "model.safetensors")
    del weights["markov_head.markov_w2.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    with pytest.raises(ConfigError, match=r"missing \(1\): markov_head.markov_w2.weight"):
        _check(target, model=str(folder))
    config = json.loads((drafter / "config.json").read_text())
    config["markov_head_type"] = "lstm"
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="markov_head_type 'lstm' is not one of vanilla, gated, rnn"):
        _check(target, model=str(folder))


def test_parallel_drafting_may_not_be_set(target, drafter):
    with pytest.raises(ConfigError, match="selects parallel drafting automatically"):
        _check(target, model=str(drafter), parallel_drafting=False)


def test_a_pipeline_is_refused_with_the_guides_alternatives(target, drafter):
    """The engine refuses pipelines today; DSpark's own rule stands for when it has them."""
    from sonar_core.config import validate_speculative_config
    from sonar_core.config.target import target_info_for
    from sonar_core.plugins.manager import get_plugin_manager

    piped = target_info_for(str(target)).with_parallelism(1, 2)
    config = {"method": "dspark", "model": str(drafter), "num_speculative_tokens": 7}
    with pytest.raises(ConfigError) as info:
        validate_speculative_config(config, piped, get_plugin_manager(), log_warnings=False)
    assert info.value.field == "speculative_config.method"
    assert "DSpark does not support pipeline parallelism" in info.value.message
    assert "tensor parallelism" in info.value.fix and "data parallelism" in info.value.fix
