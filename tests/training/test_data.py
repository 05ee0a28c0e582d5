"""The self-distillation data: prompts of every domain, hidden states equal to the target's own
forward, generation that resumes chunk by chunk to the same files, settings that cannot be mixed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from training_kit import LAYERS, data_spec

from sonar_core.errors import ConfigError
from sonar_core.spec_decode.hidden_state_files import read_hidden_states
from sonar_core.training.data import SelfDistillationData, held_out_prompts, resolved_dtype, training_prompts
from sonar_core.training.prompts import CONVERSATION, DOMAINS, build_conversation_prompts, build_prompts

WORKLOADS = Path(__file__).resolve().parents[2] / "sonar_core" / "bench" / "workloads"


def test_prompts_are_deterministic_distinct_and_cover_every_domain():
    prompts = build_prompts(200, seed=7)
    assert prompts == build_prompts(200, seed=7)
    assert prompts[:50] == build_prompts(50, seed=7)  # a longer list extends a shorter one
    assert len({p.text for p in prompts}) == 200
    assert {p.domain for p in prompts} == set(DOMAINS)
    assert build_prompts(20, seed=8) != build_prompts(20, seed=7)


def test_conversation_prompts_are_deterministic_distinct_and_their_own_list():
    prompts = build_conversation_prompts(600, seed=7)
    assert prompts == build_conversation_prompts(600, seed=7)
    assert prompts[:80] == build_conversation_prompts(80, seed=7)
    assert len({p.text for p in prompts}) == 600 and {p.domain for p in prompts} == {CONVERSATION}
    assert not {p.id for p in prompts} & {p.id for p in build_prompts(600, seed=7)}
    assert build_conversation_prompts(20, seed=8) != build_conversation_prompts(20, seed=7)


def test_held_out_prompts_are_not_trained_on_and_no_benchmark_prompt_is(target):
    spec = data_spec(target, num_prompts=300, conversation_prompts=200)
    trained = {p.text for p in training_prompts(spec)}
    assert len(trained) == 500
    held_out = held_out_prompts(spec, 40)
    assert len(held_out) == 40 and not trained & {p.text for p in held_out}
    assert sum(p.domain == CONVERSATION for p in held_out) == 16  # their share of the data
    benchmark = {
        message["content"]
        for path in WORKLOADS.glob("*.jsonl")
        for line in path.read_text().splitlines()
        for message in json.loads(line).get("messages", [])
    }
    assert not (trained | {p.text for p in held_out}) & benchmark


def test_exported_states_equal_the_targets_forward(data_dir, target):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    for path in sorted(data_dir.glob("*.safetensors"))[:3]:
        record = read_hidden_states(path)
        assert record.layer_ids == LAYERS and record.prompt_length < len(record.token_ids)
        with torch.no_grad():
            reference = model(record.token_ids[None, :-1], output_hidden_states=True).hidden_states
        for column, layer in enumerate(LAYERS):
            # Raw residual states reach ~100 here; float32 summation order shows at 1e-6 of that.
            expected = reference[layer][0]
            scale = float(expected.abs().max())
            torch.testing.assert_close(record.hidden_states[:, column], expected, rtol=0, atol=1e-5 * scale)
        # transformers' last entry is the final, normed state.
        torch.testing.assert_close(record.final_hidden_states, reference[-1][0], rtol=1e-4, atol=1e-4)


def test_an_interrupted_chunk_is_generated_again_whole_and_identical(tmp_path, data_dir, target):
    spec = data_spec(target)
    folder = tmp_path / "data"
    shutil.copytree(data_dir, folder)
    files = SelfDistillationData(folder).files(spec)
    before = {path.name: load_file(path) for path in files}
    chunk = spec.chunk_size
    # An interruption in the second chunk: one of its files missing, the others already written.
    files[chunk + 1].unlink()
    assert SelfDistillationData(folder).generate(spec) == len(files) - chunk
    for path in SelfDistillationData(folder).files(spec):
        after = load_file(path)
        assert after.keys() == before[path.name].keys()
        for name, tensor in after.items():
            assert torch.equal(tensor, before[path.name][name]), (path.name, name)
    # Nothing is left to do, and more prompts extend the same folder.
    assert SelfDistillationData(folder).generate(spec) == 0
    assert SelfDistillationData(folder).generate(data_spec(target, num_prompts=20)) == 4


def test_a_folder_of_other_settings_is_refused(tmp_path, data_dir, target):
    folder = tmp_path / "data"
    shutil.copytree(data_dir, folder)
    with pytest.raises(ConfigError, match="max_tokens: 24 -> 30"):
        SelfDistillationData(folder).generate(data_spec(target, max_tokens=30))
    (folder / next(folder.glob("*.safetensors")).name).unlink()
    with pytest.raises(ConfigError, match="lacks 1 of its 16 data files"):
        SelfDistillationData(folder).files(data_spec(target))


def test_conversation_prompts_add_to_a_folder_without_redoing_it(tmp_path, data_dir, target):
    folder = tmp_path / "data"
    shutil.copytree(data_dir, folder)
    before = {path.name: path.read_bytes() for path in folder.glob("*.safetensors")}
    # 16 prompts of the four domains fill two chunks of 8; the conversation list has its own.
    assert SelfDistillationData(folder).generate(data_spec(target, conversation_prompts=3)) == 3
    files = SelfDistillationData(folder).files(data_spec(target, conversation_prompts=3))
    assert len(files) == 19 and sum(path.name.startswith(CONVERSATION) for path in files) == 3
    assert {name: (folder / name).read_bytes() for name in before} == before
    assert json.loads((folder / "manifest.json").read_text())["conversation_prompts"] == 3


def test_auto_dtype_is_recorded_as_the_dtype_it_resolves_to(tmp_path, data_dir, target):
    assert data_spec(target, dtype="auto").comparable()["dtype"] == resolved_dtype("auto") != "auto"
    folder = tmp_path / "data"
    shutil.copytree(data_dir, folder)
    manifest = json.loads((folder / "manifest.json").read_text())
    assert manifest["dtype"] == "float32"
    # A folder that recorded 'auto' (its dtype unknown now) is refused, saying how to state it.
    (folder / "manifest.json").write_text(json.dumps({**manifest, "dtype": "auto"}))
    with pytest.raises(ConfigError, match="dtype: 'auto' -> 'float32'") as refused:
        SelfDistillationData(folder).generate(data_spec(target))
    assert "manifest.json" in refused.value.fix
