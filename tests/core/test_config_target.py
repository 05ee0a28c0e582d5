"""TargetInfo: a checkpoint's limits from its config only (config.json or GGUF metadata)."""

from __future__ import annotations

import json

import gguf
import numpy as np
import pytest

from sonar_core.config import TargetInfo, target_info_for
from sonar_core.errors import ConfigError


def test_from_model_dir(make_model_dir):
    info = target_info_for(str(make_model_dir(vocab_size=1000, max_position_embeddings=4096)), tensor_parallel_size=1)
    assert info.architectures == ("LlamaForCausalLM",)
    assert (info.model_type, info.vocab_size, info.max_position_embeddings) == ("llama", 1000, 4096)
    assert info.hf_config["vocab_size"] == 1000
    assert info.source.endswith("config.json")
    assert TargetInfo.from_model(info.source.removesuffix("/config.json")) == info


def test_multimodal_config_is_read_through_its_text_config(make_model_dir):
    folder = make_model_dir(
        architectures=["Gemma3ForConditionalGeneration"], model_type="gemma3", vocab_size=None,
        max_position_embeddings=None, text_config={"vocab_size": 262144, "max_position_embeddings": 131072},
    )
    info = target_info_for(str(folder))
    assert (info.model_type, info.vocab_size, info.max_position_embeddings) == ("gemma3", 262144, 131072)


def test_the_smallest_stated_length_wins(make_model_dir):
    info = target_info_for(str(make_model_dir(max_position_embeddings=4096, seq_length=2048)))
    assert info.max_position_embeddings == 2048


@pytest.mark.parametrize(
    ("rope", "expected"),
    [
        ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}, 131072),
        ({"type": "linear", "factor": 2.0}, 81920),
        ({"rope_type": "llama3", "factor": 8.0}, 40960),
        ({"rope_type": "default", "rope_theta": 10000.0}, 40960),
    ],
)
def test_rope_scaling_extends_the_limit(make_model_dir, rope, expected):
    info = target_info_for(str(make_model_dir(max_position_embeddings=40960, rope_scaling=rope)))
    assert info.max_position_embeddings == expected


def write_gguf(path, arch="qwen2", context=1024, vocab=300):
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_context_length(context)
    writer.add_block_count(2)
    writer.add_embedding_length(64)
    writer.add_vocab_size(vocab)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_gguf_metadata(tmp_path):
    path = write_gguf(tmp_path / "tiny.gguf")
    info = target_info_for(str(path))
    assert info.architectures == ("Qwen2ForCausalLM",)
    assert (info.model_type, info.vocab_size, info.max_position_embeddings) == ("qwen2", 300, 1024)
    assert info.hf_config["num_hidden_layers"] == 2
    assert target_info_for(str(tmp_path)) == info  # a folder holding one GGUF file


def test_folder_with_several_gguf_files(tmp_path):
    write_gguf(tmp_path / "a.gguf")
    write_gguf(tmp_path / "b.gguf")
    with pytest.raises(ConfigError, match="2 .gguf files"):
        target_info_for(str(tmp_path))


def test_folder_without_a_config(tmp_path):
    with pytest.raises(ConfigError, match="neither config.json nor a .gguf file"):
        target_info_for(str(tmp_path))


def test_invalid_config_json(tmp_path):
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        target_info_for(str(tmp_path))


def test_errors_name_the_callers_field(tmp_path):
    with pytest.raises(ConfigError) as info:
        target_info_for(str(tmp_path / "missing"), field="speculative_config.model")
    assert info.value.field == "speculative_config.model"


def test_config_json_file_itself(make_model_dir):
    folder = make_model_dir()
    assert target_info_for(str(folder / "config.json")).vocab_size == json.loads((folder / "config.json").read_text())["vocab_size"]


def test_gguf_metadata_is_read_once_then_cached(tmp_path, monkeypatch):
    """Parsing a real vocabulary's metadata takes seconds, so the second check reads the cache."""
    import gguf

    monkeypatch.setenv("SONAR_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(tmp_path / "tiny.gguf")
    first = target_info_for(str(path))
    assert list((tmp_path / "cache" / "gguf-metadata").glob("tiny-*.json"))

    def no_parsing(*args, **kwargs):
        raise AssertionError("the GGUF file was parsed again")

    monkeypatch.setattr(gguf, "GGUFReader", no_parsing)
    assert target_info_for(str(path)) == first
    write_gguf(path)  # a changed file (new modification time) is read afresh
    with pytest.raises(AssertionError, match="parsed again"):
        target_info_for(str(path))
