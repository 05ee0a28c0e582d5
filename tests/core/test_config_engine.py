"""Every rule of the engine configuration, through the Python API."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from sonar_core.config import EngineConfig, TargetInfo, validate_config, validate_engine_config
from sonar_core.errors import ConfigError
from sonar_core.plugins import get_plugin_manager


def target(limit: int | None = 512) -> TargetInfo:
    return TargetInfo(("LlamaForCausalLM",), "llama", 256, limit, source="model/config.json")


def build_error(**kwargs) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        EngineConfig.build(**kwargs)
    return info.value


def test_defaults():
    config = EngineConfig()
    assert (config.model, config.dtype, config.device, config.seed) == (None, "auto", "auto", 0)
    assert (config.max_num_seqs, config.block_size, config.gpu_memory_utilization) == (256, 16, 0.9)
    assert config.tensor_parallel_size == 1 and config.speculative_config is None
    for name, info in EngineConfig.model_fields.items():
        assert info.description, name


@pytest.mark.parametrize("size", [0, -2])
def test_tensor_parallel_size_must_be_positive(size):
    error = build_error(tensor_parallel_size=size)
    assert error.field == "tensor_parallel_size"
    assert "--tensor-parallel-size" in error.fix


def test_tensor_parallel_size_above_one_parses():
    assert EngineConfig(tensor_parallel_size=4).tensor_parallel_size == 4


@pytest.mark.parametrize("size", [2, 0])
def test_pipeline_parallel_size_is_refused_with_the_alternatives(size):
    error = build_error(pipeline_parallel_size=size)
    assert error.field == "pipeline_parallel_size"
    assert "--pipeline-parallel-size" in error.fix
    assert "tensor parallelism or data parallelism" in error.fix


@pytest.mark.parametrize("fraction", [0.0, -0.1, 1.5])
def test_gpu_memory_utilization_is_a_fraction(fraction):
    error = build_error(gpu_memory_utilization=fraction)
    assert error.field == "gpu_memory_utilization"
    assert "0.9" in error.fix


@pytest.mark.parametrize(
    ("name", "canonical"),
    [("auto", "auto"), ("fp32", "float32"), ("float", "float32"), ("half", "float16"), ("FP16", "float16"),
     ("bf16", "bfloat16"), ("torch.bfloat16", "bfloat16")],
)
def test_dtype_names(name, canonical):
    assert EngineConfig(dtype=name).dtype == canonical


def test_unknown_dtype():
    error = build_error(dtype="fp8")
    assert error.field == "dtype"
    assert "bfloat16" in error.fix


def test_resolved_dtype_and_device():
    assert EngineConfig(device="cpu", dtype="fp32").torch_dtype() == torch.float32
    assert EngineConfig(device="cpu", dtype="bf16").torch_dtype() == torch.bfloat16
    assert EngineConfig(device="cpu").torch_device() == torch.device("cpu")
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert EngineConfig().resolved_device() == expected


@pytest.mark.parametrize("device", ["tpu", "cpu:1", "cuda:x"])
def test_unknown_device(device):
    assert build_error(device=device).field == "device"


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_requested_without_a_cuda_device():
    error = build_error(device="cuda")
    assert error.field == "device"
    assert "--device cpu" in error.fix


@pytest.mark.parametrize("field", ["max_model_len", "max_num_seqs", "max_num_batched_tokens", "block_size"])
def test_counts_must_be_positive(field):
    error = build_error(**{field: 0})
    assert error.field == field
    assert "--" + field.replace("_", "-") in error.fix


def test_kv_cache_memory_must_be_positive():
    assert build_error(kv_cache_memory_gb=0).field == "kv_cache_memory_gb"


def test_token_budget_must_cover_one_token_per_sequence():
    error = build_error(max_num_seqs=64, max_num_batched_tokens=32)
    assert error.field == "max_num_batched_tokens"
    assert "at least 64" in error.fix


def test_token_budget_default():
    assert EngineConfig().token_budget(512) == 2048
    assert EngineConfig().token_budget(8192) == 8192
    assert EngineConfig(max_num_batched_tokens=300).token_budget(8192) == 300


def test_unknown_keyword_suggests_the_field():
    error = build_error(max_num_seq=8)
    assert error.field == "max_num_seq"
    assert "did you mean 'max_num_seqs'?" in error.fix


def test_type_errors_name_the_field():
    error = build_error(max_num_seqs="many")
    assert error.field == "max_num_seqs"
    assert error.fix == "give a whole number"


def test_several_problems_are_reported_together():
    error = build_error(dtype="fp8", gpu_memory_utilization=2.0)
    assert {error.field, *(other.field for other in error.also)} == {"dtype", "gpu_memory_utilization"}


def test_plain_constructor_raises_a_validation_error_with_the_same_message():
    with pytest.raises(ValidationError, match="tensor_parallel_size must be at least 1, got 0"):
        EngineConfig(tensor_parallel_size=0)


def test_speculative_config_as_json_text():
    config = EngineConfig(speculative_config='{"method": "ngram", "num_speculative_tokens": 4}')
    assert config.speculative_config.method == "ngram"
    error = build_error(speculative_config="{method: ngram}")
    assert error.field == "speculative_config"
    assert "single quotes" in error.fix


def test_nested_speculative_errors_name_the_nested_field():
    error = build_error(speculative_config={"method": "ngram", "num_speculative_tokens": 0})
    assert error.field == "speculative_config.num_speculative_tokens"


def test_max_model_len_cannot_exceed_the_models_limit():
    with pytest.raises(ConfigError) as info:
        validate_engine_config(EngineConfig(max_model_len=1024), target(512))
    assert info.value.field == "max_model_len"
    assert "--max-model-len 512" in info.value.fix


def test_max_model_len_defaults_to_the_models_limit():
    assert validate_engine_config(EngineConfig(), target(512)).max_model_len == 512
    assert validate_engine_config(EngineConfig(max_model_len=100), target(512)).max_model_len == 100


def test_max_model_len_is_required_when_the_model_states_no_limit():
    with pytest.raises(ConfigError, match="states no maximum sequence length"):
        validate_engine_config(EngineConfig(), target(None))


def test_validate_config_reads_the_model_folder(make_model_dir, manager_with):
    from plugin_fakes import FakeMethodPlugin

    folder = make_model_dir(max_position_embeddings=300)
    manager = manager_with(FakeMethodPlugin("lookup"))
    validated = validate_config(
        {"model": str(folder), "speculative_config": {"method": "lookup", "num_speculative_tokens": 2}}, manager
    )
    assert validated.engine.max_model_len == 300
    assert validated.target.max_position_embeddings == 300
    assert validated.speculative.method == "lookup"
    with pytest.raises(ConfigError, match="exceeds the model's limit of 300"):
        validate_config({"model": str(folder), "max_model_len": 301}, manager)


def test_model_that_does_not_exist(tmp_path):
    with pytest.raises(ConfigError) as info:
        validate_config({"model": str(tmp_path / "missing")}, get_plugin_manager(load_entry_points=False))
    assert info.value.field == "model"
    assert "local folder" in info.value.fix


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        ({"avx2", "fma", "avx512f", "avx512_bf16"}, "bfloat16"),
        ({"avx2", "fma", "amx_bf16"}, "bfloat16"),
        ({"avx2", "fma"}, "bfloat16"),
        ({"avx", "sse4_2"}, "float32"),
        (set(), "float32"),
    ],
)
def test_auto_dtype_on_the_cpu_follows_fast_bfloat16(monkeypatch, flags, expected):
    """bfloat16 where the CPU multiplies it in hardware (AVX-512 BF16, AMX) or widens it in
    registers (AVX2 + FMA), float32 elsewhere."""
    from sonar_core import cpu_features

    monkeypatch.setattr(cpu_features, "_cpuinfo", lambda: ("a CPU", frozenset(flags)))
    assert EngineConfig(device="cpu").resolved_dtype() == expected
    assert EngineConfig(device="cpu", dtype="float32").resolved_dtype() == "float32"
