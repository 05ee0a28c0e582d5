"""GGUF files, converted once into a cached Hugging Face folder.

Dequantizing a GGUF checkpoint takes seconds to minutes, so the result (config.json,
model.safetensors in float32, tokenizer files, generation_config.json) is written once under
``$SONAR_CACHE_DIR/gguf`` (default ``~/.cache/sonar/gguf``) in a folder keyed by the file's resolved
path, size and modification time; later loads read the folder. A changed file gets a new key and is
converted again. The folder appears by an atomic rename of a finished temporary folder, so an
interrupted conversion never leaves a half-written cache behind.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from sonar_core.model_files import cache_root, cached_folder, file_cache_key, file_identity

logger = logging.getLogger(__name__)

SOURCE_RECORD = "sonar_gguf_source.json"


def gguf_cache_dir(gguf_path: Path) -> Path:
    """Where the conversion of ``gguf_path`` lives (whether or not it exists yet)."""
    return cache_root() / "gguf" / file_cache_key(Path(gguf_path))


def is_converted(folder: Path) -> bool:
    """True when ``folder`` holds a finished conversion (the provenance record is written last)."""
    return (folder / SOURCE_RECORD).is_file()


def convert_gguf(gguf_path: Path) -> Path:
    """The cached Hugging Face folder of ``gguf_path``, converting it first if needed."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {gguf_path}")
    dest = gguf_cache_dir(gguf_path)
    if not is_converted(dest):
        logger.info("converting %s to %s (once; later loads use the cache)", gguf_path, dest)
    return cached_folder(dest, lambda partial: _write_hf_folder(gguf_path, partial), is_converted)


def gguf_tokenizer(gguf_path: Path) -> Any:
    """The tokenizer transformers' GGUF reader makes of ``gguf_path`` (vocabulary, merges, special
    tokens and chat template from its metadata)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)


def _write_hf_folder(gguf_path: Path, out: Path) -> None:
    """Dequantize ``gguf_path`` with transformers' GGUF reader and save it as a HF folder."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)
    if getattr(model, "hf_quantizer", None) is not None:
        # Otherwise config.json keeps a quantization_config pointing at the GGUF file.
        model.hf_quantizer.remove_quantization_config(model)
    tokenizer = gguf_tokenizer(gguf_path)
    tokenizer.model_max_length = model.config.max_position_embeddings
    if model.generation_config.eos_token_id is None and tokenizer.eos_token_id is not None:
        model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / SOURCE_RECORD).write_text(json.dumps(file_identity(gguf_path), indent=2) + "\n")
