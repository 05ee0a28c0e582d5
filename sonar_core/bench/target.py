"""The target model as every engine of a benchmark needs it: a Hugging Face folder (Sonar,
transformers, vLLM), the GGUF file when there is one (llama.cpp), the tokenizer that renders the
prompts, and the end-of-sequence ids every engine stops at."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sonar_core.model_files import resolve_model_path
from sonar_core.models.loader import eos_token_ids, load_tokenizer, prepare_model_dir, read_hf_config


@dataclass
class BenchTarget:
    model: str | None  # as the user named it (None: the embedded default model)
    model_dir: Path
    gguf_path: Path | None
    tokenizer: Any
    eos_token_ids: list[int]
    num_layers: int
    vocab_size: int


def load_target(model: str | None) -> BenchTarget:
    """Resolve ``model`` offline (converting a GGUF file once, as the engine does)."""
    resolved = resolve_model_path(model)
    gguf = _gguf_file(resolved)
    model_dir = prepare_model_dir(resolved)
    _, hf_config = read_hf_config(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    return BenchTarget(
        model=model,
        model_dir=model_dir,
        gguf_path=gguf,
        tokenizer=load_tokenizer(model_dir),
        eos_token_ids=eos_token_ids(model_dir, hf_config),
        num_layers=int(config.get("num_hidden_layers", 0)),
        vocab_size=int(config.get("vocab_size", 0)),
    )


def _gguf_file(path: Path) -> Path | None:
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        return ggufs[0] if len(ggufs) == 1 else None
    return None
