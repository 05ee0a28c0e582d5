"""extract_hidden_states: the exported states equal transformers' for the same tokens whatever the
chunking; files are whole or absent; a failed write fails only its request."""

from __future__ import annotations

import errno
import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from aphrodite import LLM, SamplingParams
from sonar_core.config import target_info_for, validate_speculative_config
from sonar_core.entrypoints.cli import main
from sonar_core.errors import ConfigError
from sonar_core.plugins import get_plugin_manager
from sonar_core.spec_decode import hidden_state_files
from sonar_core.spec_decode.hidden_state_files import (
    HiddenStateRecord,
    file_name,
    iter_hidden_state_files,
    read_hidden_states,
    write_hidden_states,
)
from sonar_core.testing.checkpoints import build_tiny_checkpoint

LAYERS = 4
PARAMS = SamplingParams(temperature=0.0, max_tokens=9, ignore_eos=True)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_checkpoint(tmp_path_factory.mktemp("xhs-target"), arch="qwen3", num_layers=LAYERS, head_dim=32)


def _prompts() -> list[list[int]]:
    rng = random.Random(3)
    return [[rng.randrange(3, 512) for _ in range(length)] for length in (1, 5, 23, 40, 12)]


def _export(target: Path, out: Path, **engine) -> tuple[list, LLM]:
    llm = LLM(
        model=str(target), dtype="float32", device="cpu",
        speculative_config={"method": "extract_hidden_states", "output_dir": str(out), "layer_ids": [0, 2, LAYERS]},
        **engine,
    )
    outputs = llm.generate(_prompts(), PARAMS, use_tqdm=False)
    return outputs, llm


@pytest.mark.parametrize("engine", [{}, {"max_num_batched_tokens": 8, "max_num_seqs": 4}], ids=["whole", "chunked"])
def test_exported_states_equal_transformers_hidden_states(target, tmp_path, engine):
    from transformers import AutoModelForCausalLM

    outputs, llm = _export(target, tmp_path / "out", **engine)
    hf = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    records = {r.request_id: r for r in iter_hidden_state_files(tmp_path / "out")}
    assert len(records) == len(outputs)
    for output in outputs:
        record = records[output.request_id]
        tokens = output.prompt_token_ids + output.outputs[0].token_ids
        assert record.token_ids.tolist() == tokens
        assert record.prompt_length == len(output.prompt_token_ids)
        assert record.layer_ids == (0, 2, LAYERS)
        assert record.hidden_states.shape == (len(tokens) - 1, 3, 64)
        with torch.no_grad():
            states = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states
        # transformers' tuple has Sonar's index except its last entry, which is normed.
        for layer in (0, 2):
            assert (record.layer(layer) - states[layer][0]).abs().max().item() < 1e-4
        last = llm.engine.model.model.norm(record.layer(LAYERS))
        assert (last - states[LAYERS][0]).abs().max().item() < 1e-4
        assert (record.final_hidden_states - states[LAYERS][0]).abs().max().item() < 1e-4
    assert llm.get_spec_decode_metrics().num_draft_tokens == 0


def test_preempted_requests_are_exported_whole(target, tmp_path):
    reference, _ = _export(target, tmp_path / "roomy")
    outputs, llm = _export(
        target, tmp_path / "tight", max_num_seqs=5, block_size=4, max_model_len=64,
        # 20 blocks of 4 tokens (K and V, 2 heads x 32 dims, fp32, 4 layers: 8192 bytes a block) hold
        # about half the batch, so later requests preempt earlier ones.
        kv_cache_memory_gb=20 * 8192 / 2**30,
    )
    assert llm.engine.num_preemptions > 0
    for a, b in zip(iter_hidden_state_files(tmp_path / "roomy"), iter_hidden_state_files(tmp_path / "tight"), strict=True):
        assert a.token_ids.tolist() == b.token_ids.tolist()
        torch.testing.assert_close(a.hidden_states, b.hidden_states, rtol=1e-4, atol=1e-4)


def test_a_failed_write_fails_only_its_request(target, tmp_path, monkeypatch):
    from sonar_extract_hidden_states import exporter

    failing = {"2"}
    write = exporter.write_hidden_states

    def disk_full(directory, record):
        if record.request_id in failing:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(directory, record)

    monkeypatch.setattr(exporter, "write_hidden_states", disk_full)
    outputs, llm = _export(target, tmp_path / "out")
    errors = {o.request_id: o.error for o in outputs}
    assert errors.pop("2") == f"its hidden states could not be written to {tmp_path / 'out'}: No space left on device"
    assert set(errors.values()) == {None}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [file_name(i) for i in sorted(errors)]
    # The engine goes on serving.
    assert llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)[0].error is None


def test_an_interrupted_write_leaves_no_file(tmp_path, monkeypatch):
    record = HiddenStateRecord("a/b", torch.arange(4), 2, (1,), torch.zeros(3, 1, 8), None)

    def half_written(tensors, path, metadata):
        Path(path).write_bytes(b"partial")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(hidden_state_files, "save_file", half_written)
    with pytest.raises(OSError):
        write_hidden_states(tmp_path, record)
    assert list(tmp_path.iterdir()) == []


def test_files_round_trip_and_foreign_files_are_refused(tmp_path):
    record = HiddenStateRecord("cmpl-7/0", torch.arange(5), 3, (2, 4), torch.randn(4, 2, 8), torch.randn(4, 8), "m")
    path = write_hidden_states(tmp_path, record)
    assert path.name == file_name("cmpl-7/0") and path.name.startswith("cmpl-7_0-")
    back = read_hidden_states(path)
    assert back.request_id == "cmpl-7/0" and back.layer_ids == (2, 4) and back.prompt_length == 3
    assert torch.equal(back.layer(4), record.hidden_states[:, 1])
    save_file({"x": torch.zeros(1)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="is not a sonar-hidden-states file"):
        read_hidden_states(tmp_path / "other.safetensors")


@pytest.fixture(scope="module")
def manager():
    return get_plugin_manager(environ={"SONAR_PLUGINS": "extract_hidden_states"})


def _check(target: Path, manager, **fields):
    return validate_speculative_config(
        {"method": "extract_hidden_states", **fields}, target_info_for(str(target)), manager, log_warnings=False
    )


def test_defaults_need_only_the_folder(target, tmp_path, manager):
    resolved = _check(target, manager, output_dir=str(tmp_path / "new" / "folder"))
    assert resolved.num_speculative_tokens == 1
    assert not (tmp_path / "new").exists()  # checking creates nothing


def test_an_output_dir_that_cannot_be_a_folder_is_refused(target, tmp_path, manager):
    (tmp_path / "file").write_text("x")
    with pytest.raises(ConfigError) as info:
        _check(target, manager, output_dir=str(tmp_path / "file" / "sub"))
    assert info.value.field == "speculative_config.output_dir"
    assert "exists and is not a folder" in info.value.message
    assert "folder you can write to" in info.value.fix


def test_layers_outside_the_target_and_a_model_are_refused(target, tmp_path, manager):
    with pytest.raises(ConfigError, match=r"\[5\], outside the target's 0..4"):
        _check(target, manager, output_dir=str(tmp_path), layer_ids=[1, 5])
    with pytest.raises(ConfigError, match="loads no checkpoint"):
        _check(target, manager, output_dir=str(tmp_path), model=str(target))
    with pytest.raises(ConfigError, match="output_dir"):
        _check(target, manager)


def test_check_config_reports_an_unwritable_folder(target, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SONAR_PLUGINS", "extract_hidden_states")
    (tmp_path / "file").write_text("x")
    spec = json.dumps({"method": "extract_hidden_states", "output_dir": str(tmp_path / "file")})
    assert main(["serve", str(target), "--speculative-config", spec, "--check-config"]) == 2
    assert "speculative_config.output_dir" in capsys.readouterr().err


def test_the_server_fails_only_the_request_whose_export_fails(target, tmp_path, monkeypatch):
    import argparse

    from fastapi.testclient import TestClient
    from sonar_extract_hidden_states import exporter

    from sonar_core.config import EngineConfig
    from sonar_core.engine.llm_engine import LLMEngine
    from sonar_core.entrypoints.openai.server import build_app

    write = exporter.write_hidden_states
    calls = []

    def second_write_fails(directory, record):
        calls.append(record.request_id)
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(directory, record)

    monkeypatch.setattr(exporter, "write_hidden_states", second_write_fails)
    engine = LLMEngine(EngineConfig(
        model=str(target), dtype="float32", device="cpu", max_model_len=128,
        speculative_config={"method": "extract_hidden_states", "output_dir": str(tmp_path / "out")},
    ))
    args = argparse.Namespace(api_key=None, served_model_name=None, disable_log_stats=True)
    with TestClient(build_app(engine, args)) as client:
        body = {"model": engine.model_name, "prompt": [5, 6, 7], "max_tokens": 4, "temperature": 0}
        first = client.post("/v1/completions", json=body)
        failed = client.post("/v1/completions", json=body)
        third = client.post("/v1/completions", json=body)
    assert first.status_code == 200 and third.status_code == 200
    assert failed.status_code == 500
    assert "No space left on device" in failed.json()["error"]["message"]
    assert len(list((tmp_path / "out").iterdir())) == 2
