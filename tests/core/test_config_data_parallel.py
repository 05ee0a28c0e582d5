"""The rules of ``data_parallel_size``: through the Python API, the command line, and the engine,
which is one replica and refuses more."""

from __future__ import annotations

import pytest
import torch

from sonar_core.config import EngineConfig
from sonar_core.errors import ConfigError


def test_data_parallel_size_defaults_to_one_and_must_be_positive():
    assert EngineConfig().data_parallel_size == 1
    assert EngineConfig(data_parallel_size=4).data_parallel_size == 4
    for size in (0, -2):
        with pytest.raises(ConfigError) as info:
            EngineConfig.build(data_parallel_size=size)
        assert info.value.field == "data_parallel_size"
        assert "--data-parallel-size to 1 or more" in info.value.fix


def test_replicas_on_cuda_need_devices_of_their_own_and_no_named_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert EngineConfig(device="cuda", data_parallel_size=2).data_parallel_size == 2
    with pytest.raises(ConfigError, match="3 replicas need a CUDA device each, 3 in all, but only 2 exist") as info:
        EngineConfig.build(device="cuda", data_parallel_size=3)
    assert "--data-parallel-size to at most 2" in info.value.fix
    with pytest.raises(ConfigError, match=r"2 CUDA devices each \(tensor_parallel_size=2\), 4 in all") as info:
        EngineConfig.build(device="cuda", data_parallel_size=2, tensor_parallel_size=2)
    assert "--data-parallel-size to at most 1" in info.value.fix
    with pytest.raises(ConfigError, match="cannot share the one device 'cuda:1'") as info:
        EngineConfig.build(device="cuda:1", data_parallel_size=2)
    assert "--device cuda" in info.value.fix


def test_the_engine_is_one_replica_and_points_to_the_server(make_model_dir):
    from sonar_core.entrypoints.llm import LLM

    with pytest.raises(ConfigError) as info:
        LLM(model=str(make_model_dir()), device="cpu", data_parallel_size=2)
    assert info.value.field == "data_parallel_size"
    assert "aphrodite serve MODEL --data-parallel-size N" in info.value.fix


def test_the_flags_set_the_field():
    from sonar_core.entrypoints.cli import build_parser
    from sonar_core.entrypoints.commands.serve import engine_config_from_args

    parser = build_parser()
    for flags in (["--data-parallel-size", "3"], ["-dp", "3"]):
        assert engine_config_from_args(parser.parse_args(["serve", *flags])).data_parallel_size == 3


@pytest.mark.parametrize(
    ("flags", "expected"),
    [
        (["-dp", "0"], ["data_parallel_size: must be a positive number, got 0", "--data-parallel-size to 1 or more"]),
        (["--data-parallel-size", "two"], ["argument --data-parallel-size/-dp: invalid int value: 'two'"]),
    ],
)
def test_data_parallel_rules_on_the_command_line(run_aphrodite, make_model_dir, flags, expected):
    result = run_aphrodite("serve", str(make_model_dir()), "--check-config", *flags)
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    for text in expected:
        assert text in result.stderr, result.stderr


def test_generate_refuses_replicas_with_the_servers_flag(run_aphrodite, make_model_dir):
    result = run_aphrodite("generate", str(make_model_dir()), "--prompt", "hi", "-dp", "2", "--device", "cpu")
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert "aphrodite serve MODEL --data-parallel-size N" in result.stderr
