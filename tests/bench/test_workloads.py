"""The shipped workloads: present, well-formed, reproducible by their script, rendered as chat."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from sonar_core.bench.workloads import (
    WARMUP_MESSAGES,
    available_workloads,
    load_workload,
    render_prompt,
    tokenize_workload,
)
from sonar_core.errors import ConfigError
from sonar_core.testing.checkpoints import build_bytelevel_tokenizer

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "make_workloads.py"
EXPECTED = {"code_edit", "chat", "summarize", "agent"}


def _script():
    spec = importlib.util.spec_from_file_location("make_workloads", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_every_workload_is_shipped_with_a_few_dozen_unique_requests() -> None:
    assert set(available_workloads()) == EXPECTED
    for name in EXPECTED:
        workload = load_workload(name)
        ids = [record["id"] for record in workload.records]
        assert 20 <= len(ids) <= 48
        assert len(set(ids)) == len(ids)
        assert workload.description


def test_the_script_reproduces_the_shipped_files(tmp_path: Path) -> None:
    """Fixed seeds: regenerating gives byte-identical files, so the workloads can be audited."""
    script = _script()
    for name, records in script.build(script.SEED).items():
        shipped = available_workloads()[name].read_text(encoding="utf-8").splitlines()
        assert [json.loads(line) for line in shipped[1:]] == records


def test_code_edit_prompts_hold_the_file_the_answer_repeats() -> None:
    script = _script()
    for record in load_workload("code_edit").records:
        text = record["messages"][-1]["content"]
        assert any(code in text for code in script.CODE_FILES.values())


def test_agent_requests_repeat_earlier_turns_across_requests() -> None:
    records = load_workload("agent").records
    calls = [m["content"] for r in records for m in r["messages"] if m["role"] == "assistant"]
    assert len(calls) > len(set(calls))  # the same tool calls recur in several requests
    assert all(r["messages"][-1]["role"] == "user" for r in records)


def test_head_takes_a_fixed_prefix() -> None:
    workload = load_workload("chat")
    assert [r["id"] for r in workload.head(3).records] == [r["id"] for r in workload.records[:3]]
    assert len(workload.head(None).records) == len(workload.records)


def test_prompts_are_rendered_with_the_chat_template() -> None:
    tokenizer = build_bytelevel_tokenizer(512)
    requests = tokenize_workload(tokenizer, load_workload("chat").head(2))
    text = tokenizer.decode(requests[0].prompt_token_ids)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    assert render_prompt(tokenizer, WARMUP_MESSAGES) != requests[0].prompt_token_ids


def test_a_workload_file_by_path(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl"
    path.write_text('{"meta": {"workload": "mine", "description": "d"}}\n{"messages": [{"role": "user", "content": "hi"}]}\n')
    workload = load_workload(str(path))
    assert workload.name == "mine" and workload.records[0]["id"] == "mine-000"


@pytest.mark.parametrize(
    ("content", "message"),
    [("", "holds no requests"), ("{oops\n", "not JSON"), ('{"prompt": "x"}\n', "no 'messages'")],
)
def test_bad_workload_files_are_config_errors(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(content)
    with pytest.raises(ConfigError, match=message):
        load_workload(str(path))


def test_an_unknown_workload_names_the_shipped_ones() -> None:
    with pytest.raises(ConfigError, match="code_edit"):
        load_workload("no-such-workload")
