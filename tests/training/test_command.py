"""``aphrodite train-draft`` end to end on the tiny target: data, training, the written head, its
acceptance on held-out prompts; run again, it resumes and redoes nothing."""

from __future__ import annotations

import json

import torch

from sonar_core.entrypoints.cli import main
from sonar_core.spec_decode.draft_checkpoint import DraftCheckpoint


def _args(target, output, *extra: str) -> list[str]:
    return ["train-draft", str(target), "--method", "eagle3", "--output", str(output), "--num-prompts", "8",
            "--max-tokens", "16", "--max-num-seqs", "2", "--epochs", "1", "--draft-vocab-size", "64",
            "--dtype", "float32", "--eval-prompts", "2", "--eval-max-tokens", "8", "--no-progress", *extra]


def test_train_draft_writes_a_head_that_loads_and_reports_its_acceptance(tmp_path, target, capsys):
    output = tmp_path / "head"
    assert main(_args(target, output)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["output"] == str(output)
    assert report["data"]["prompts"] == 8 and report["data"]["draft_vocab_size"] == 64
    assert report["training"]["steps_done"] == report["training"]["total_steps"] > 0
    evaluation = report["evaluation"]
    assert evaluation["mean_acceptance_length"] >= 1.0 and len(evaluation["per_position_acceptance_rate"]) == 3
    checkpoint = DraftCheckpoint.open(str(output))
    assert checkpoint.speculators.model_type == "eagle3" and checkpoint.speculators.speculative_tokens == 3
    assert checkpoint.shapes["d2t"] == (64,)

    assert main(_args(target, output, "--eval-prompts", "0")) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["data"]["generated_now"] == 0
    assert again["training"]["last_loss"] == report["training"]["last_loss"]


def test_an_output_folder_with_other_files_is_refused(tmp_path, target, capsys):
    output = tmp_path / "mine"
    output.mkdir()
    (output / "notes.txt").write_text("keep me")
    assert main(_args(target, output)) == 2
    assert "holds other files than a trained head" in capsys.readouterr().err
    assert (output / "notes.txt").read_text() == "keep me"


def test_bad_numbers_are_refused_before_anything_runs(tmp_path, target, capsys):
    assert main(_args(target, tmp_path / "head", "--epochs", "0")) == 2
    assert "--epochs must be at least 1" in capsys.readouterr().err


def test_conversation_prompts_and_a_head_to_start_from(tmp_path, target, capsys):
    """The flags that grow a head: the conversation set adds to the data folder, and --init-from
    fine-tunes the head written before instead of starting from random weights."""
    first = tmp_path / "head"
    assert main(_args(target, first, "--eval-prompts", "0")) == 0
    capsys.readouterr()
    work = tmp_path / "tuned.work"
    tuned = tmp_path / "tuned"
    extra = ("--conversation-prompts", "4", "--init-from", str(first), "--work-dir", str(work), "--eval-prompts", "0")
    assert main(_args(target, tuned, *extra)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["data"]["prompts"] == 8 + 4
    assert DraftCheckpoint.open(str(tuned)).speculators.model_type == "eagle3"
    assert main(_args(target, tmp_path / "other", "--conversation-prompts", "-1")) == 2
    assert "--conversation-prompts must not be negative" in capsys.readouterr().err


def test_labels_distribution_trains_and_is_its_own_setting(tmp_path, target, capsys):
    """--labels distribution trains a head that loads; a state started with the default labels
    records no labels (states of earlier versions still resume) and is refused for another kind."""
    work = tmp_path / "head.work"
    assert main(_args(target, tmp_path / "head", "--eval-prompts", "0", "--work-dir", str(work))) == 0
    capsys.readouterr()
    recorded = json.loads(torch.load(work / "eagle3-state.pt", weights_only=True)["fingerprint"])
    assert "labels" not in recorded
    assert set(recorded["head"]) == {"depth", "draft_vocab_size", "num_layers", "intermediate_size"}
    extra = ("--eval-prompts", "0", "--work-dir", str(work), "--labels", "distribution")
    assert main(_args(target, tmp_path / "soft", *extra)) == 2
    assert "holds a training run with other settings" in capsys.readouterr().err
    soft = tmp_path / "soft"
    (work / "eagle3-state.pt").unlink()
    assert main(_args(target, soft, *extra)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["training"]["steps_done"] == report["training"]["total_steps"] > 0
    assert DraftCheckpoint.open(str(soft)).speculators.model_type == "eagle3"
    assert json.loads(torch.load(work / "eagle3-state.pt", weights_only=True)["fingerprint"])["labels"] == "distribution"


def test_generated_prompts_are_answered_trained_on_and_held_out(tmp_path, target, capsys):
    """--generated-prompts trains on the prompts the target wrote into the data folder (written
    here beforehand, as a first run leaves them) and measures acceptance on its spare ones."""
    from sonar_core.training.data import GENERATED_SPARE
    from sonar_core.training.generated_prompts import FILE_NAME

    work = tmp_path / "head.work"
    (work / "data").mkdir(parents=True)
    lines = [json.dumps({"attempt": i, "text": f"write two lines about the colour number {i}"})
             for i in range(2 + GENERATED_SPARE)]
    (work / "data" / FILE_NAME).write_text("\n".join(lines) + "\n")
    extra = ("--generated-prompts", "2", "--work-dir", str(work), "--eval-prompts", "5")
    assert main(_args(target, tmp_path / "head", *extra)) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["data"]["prompts"] == 8 + 2 and report["evaluation"]["prompts"] == 5
    assert main(_args(target, tmp_path / "other", "--generated-prompts", "-3")) == 2
    assert "--generated-prompts must not be negative" in capsys.readouterr().err
