"""Tiny targets and drafts for the draft_model tests, including one with another vocabulary."""

import json
import random
from pathlib import Path

import pytest

from sonar_core.testing.checkpoints import build_tiny_checkpoint, build_truncated_draft


@pytest.fixture(scope="session")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("dm-target"), arch="llama", num_layers=2)


@pytest.fixture(scope="session")
def draft(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_truncated_draft(target, tmp_path_factory.mktemp("dm-draft"), num_layers=1)


def _shuffle_token_ids(model_dir: Path, seed: int) -> None:
    """Give every token of a saved tokenizer another id, keeping its strings and merges.

    The draft then shares strings with the target under different ids, which is what two model
    families with different tokenizers look like to the vocabulary intersection.
    """
    path = model_dir / "tokenizer.json"
    data = json.loads(path.read_text())
    vocab: dict[str, int] = data["model"]["vocab"]
    ids = sorted(vocab.values())
    shuffled = ids[:]
    random.Random(seed).shuffle(shuffled)
    remap = dict(zip(ids, shuffled, strict=True))
    data["model"]["vocab"] = {token: remap[i] for token, i in vocab.items()}
    for added in data.get("added_tokens", []):
        added["id"] = remap.get(added["id"], added["id"])
    path.write_text(json.dumps(data))
    config = json.loads((model_dir / "config.json").read_text())
    for key in ("eos_token_id", "pad_token_id"):
        if isinstance(config.get(key), int):
            config[key] = remap[config[key]]
    (model_dir / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="session")
def foreign_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A draft with a smaller byte-level vocabulary (384 tokens) whose ids are shuffled."""
    folder = build_tiny_checkpoint(
        tmp_path_factory.mktemp("dm-foreign"), arch="qwen2", vocab_size=384, num_layers=1, seed=5
    )
    _shuffle_token_ids(folder, seed=11)
    return folder
