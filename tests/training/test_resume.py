"""An interrupted training run, started again, ends exactly where an uninterrupted run ends: same
weights, same optimiser state, same written head."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from training_kit import SETTINGS, make_trainer

from sonar_core.errors import ConfigError
from sonar_core.training.loop import TrainSettings, train
from sonar_core.training.methods.base import FlatBatch


@pytest.mark.parametrize("method", ["eagle3", "dflash"])
def test_resumed_run_equals_an_uninterrupted_one(method, tmp_path, dataset, training_target):
    whole = make_trainer(method, training_target, dataset)
    outcome = train(whole, dataset, SETTINGS, tmp_path / "whole.pt", {"method": method})

    interrupted = make_trainer(method, training_target, dataset)
    first = train(interrupted, dataset, SETTINGS, tmp_path / "parts.pt", {"method": method}, stop_after=7)
    assert first.steps_done == 7 and not first.finished
    # A new process: a freshly built head, whose state comes from the file.
    resumed = make_trainer(method, training_target, dataset)
    second = train(resumed, dataset, SETTINGS, tmp_path / "parts.pt", {"method": method})
    assert second.finished and second.steps_done == outcome.steps_done
    assert [r.loss for r in second.history] == [r.loss for r in outcome.history]
    for (name, a), (_, b) in zip(whole.module.state_dict().items(), resumed.module.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    written = load_file(whole.export(tmp_path / "a", torch.float32) / "model.safetensors")
    again = load_file(resumed.export(tmp_path / "b", torch.float32) / "model.safetensors")
    assert written.keys() == again.keys() and all(torch.equal(written[k], again[k]) for k in written)


def test_a_state_of_other_settings_is_refused(tmp_path, dataset, training_target):
    trainer = make_trainer("medusa", training_target, dataset)
    train(trainer, dataset, SETTINGS, tmp_path / "state.pt", {"method": "medusa"}, stop_after=2)
    other = TrainSettings(**{**SETTINGS.__dict__, "learning_rate": 1e-2})
    with pytest.raises(ConfigError, match="other settings"):
        train(make_trainer("medusa", training_target, dataset), dataset, other, tmp_path / "state.pt",
              {"method": "medusa"})


def test_an_eagle3_head_starts_from_an_earlier_head(tmp_path, dataset, training_target):
    earlier = make_trainer("eagle3", training_target, dataset, seed=1)
    train(earlier, dataset, SETTINGS, tmp_path / "earlier.pt", {"method": "eagle3"}, stop_after=3)
    head_dir = earlier.export(tmp_path / "earlier", torch.float32)
    later = make_trainer("eagle3", training_target, dataset, seed=2)
    assert not torch.equal(later.module.fc.weight, earlier.module.fc.weight)
    later.start_from(head_dir)
    for (name, a), (_, b) in zip(earlier.module.state_dict().items(), later.module.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    deeper = make_trainer("eagle3", training_target, dataset, seed=2)
    deeper.head.fc_norm = None  # another shape: refused, not half loaded
    with pytest.raises(ConfigError, match="not a head of this shape"):
        deeper.start_from(head_dir)
    with pytest.raises(ConfigError, match="cannot start from an earlier head"):
        make_trainer("medusa", training_target, dataset).start_from(head_dir)


def test_an_eagle3_head_grows_from_an_earlier_head_with_fewer_layers(tmp_path, dataset, training_target):
    earlier = make_trainer("eagle3", training_target, dataset, seed=1)
    train(earlier, dataset, SETTINGS, tmp_path / "earlier.pt", {"method": "eagle3"}, stop_after=3)
    head_dir = earlier.export(tmp_path / "earlier", torch.float32)
    grown = make_trainer("eagle3", training_target, dataset, seed=2, num_layers=2)
    grown.start_from(head_dir)
    mine = grown.module.state_dict()
    for name, tensor in earlier.module.state_dict().items():
        assert torch.equal(mine[name], tensor), name
    # The added layer passes its input through, so the grown head predicts what the earlier one
    # did, at every step of the training-time test, before any training.
    batch = FlatBatch(dataset.load(list(range(len(dataset.records))), dataset.layer_ids, final=True))
    with torch.no_grad():
        for (step, rows, out), (_, grown_rows, grown_out) in zip(
            earlier.unroll(batch), grown.unroll(batch), strict=True
        ):
            assert torch.equal(rows, grown_rows), step
            torch.testing.assert_close(grown.module.compute_logits(grown_out), earlier.module.compute_logits(out))
    # It trains from there, and a head with more layers than this one is refused.
    train(grown, dataset, SETTINGS, tmp_path / "grown.pt", {"method": "eagle3"}, stop_after=2)
    assert grown.module.layers[1].mlp.down_proj.weight.abs().sum() > 0
    with pytest.raises(ConfigError, match="no more layers"):
        make_trainer("eagle3", training_target, dataset).start_from(grown.export(tmp_path / "grown", torch.float32))
