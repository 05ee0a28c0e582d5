"""Draft weights inside the target checkpoint: a method claims their names, the target loader skips
exactly those and stays strict for every other tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from plugin_fakes import FakeMethodPlugin
from safetensors.torch import load_file, save_file

from sonar_core.config import EngineConfig
from sonar_core.engine.llm_engine import LLMEngine
from sonar_core.models.weights import CheckpointError, claimed_by, iter_checkpoint
from sonar_core.spec_decode.proposer import DraftProposal, ProposeBatch, Proposer
from sonar_core.testing.checkpoints import build_tiny_checkpoint

EXTRA = {"mtp.fc.weight": torch.randn(8, 16), "mtp.norm.weight": torch.ones(8)}


@pytest.fixture(scope="module")
def target_with_extra(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = build_tiny_checkpoint(tmp_path_factory.mktemp("claims"), arch="llama", num_layers=1)
    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, **EXTRA}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    return folder


class ClaimedWeightsProposer(Proposer):
    """Reads the claimed tensors from the target folder, as an MTP method would."""

    def __init__(self, context, prefixes: tuple[str, ...]) -> None:
        self.loaded = dict(iter_checkpoint(context.target_model_dir, include=claimed_by(prefixes)))

    def propose(self, batch: ProposeBatch) -> DraftProposal:
        return DraftProposal([[] for _ in batch.requests])


def _engine(folder: Path, manager) -> LLMEngine:
    config = EngineConfig(
        model=str(folder), dtype="float32", device="cpu",
        speculative_config={"method": "mtp_like", "num_speculative_tokens": 1},
    )
    return LLMEngine(config, manager)


def test_unclaimed_extra_tensors_still_fail_the_strict_loader(target_with_extra, manager_with):
    manager = manager_with(FakeMethodPlugin("mtp_like", create=lambda context, weights: ClaimedWeightsProposer(context, ())))
    with pytest.raises(CheckpointError, match=r"unexpected in the checkpoint \(2\): mtp.fc.weight, mtp.norm.weight"):
        _engine(target_with_extra, manager)


def test_a_claim_skips_exactly_its_tensors_and_the_method_reads_them(target_with_extra, manager_with):
    prefixes = ("mtp.",)
    plugin = FakeMethodPlugin(
        "mtp_like", claims=prefixes, create=lambda context, weights: ClaimedWeightsProposer(context, prefixes)
    )
    engine = _engine(target_with_extra, manager_with(plugin))
    proposer = engine.speculator.proposer
    assert sorted(proposer.loaded) == sorted(EXTRA)
    assert torch.equal(proposer.loaded["mtp.fc.weight"], EXTRA["mtp.fc.weight"])


def test_a_claim_does_not_hide_other_unexpected_tensors(target_with_extra, tmp_path, manager_with):
    folder = tmp_path / "target"
    folder.mkdir()
    for item in target_with_extra.iterdir():
        (folder / item.name).write_bytes(item.read_bytes())
    tensors = load_file(folder / "model.safetensors")
    save_file({**tensors, "stray.weight": torch.zeros(2)}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    plugin = FakeMethodPlugin(
        "mtp_like", claims=("mtp.",), create=lambda context, weights: ClaimedWeightsProposer(context, ("mtp.",))
    )
    with pytest.raises(CheckpointError, match=r"unexpected in the checkpoint \(1\): stray.weight"):
        _engine(folder, manager_with(plugin))
