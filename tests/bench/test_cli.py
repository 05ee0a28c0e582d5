"""``aphrodite bench`` end to end on a tiny checkpoint, with a fake peer (no timed assertions)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sonar_core.entrypoints.cli import main

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}'
SMALL = ["--num-prompts", "2", "--max-tokens", "8", "--threads", "1", "--kv-cache-memory-gb", "0.01", "--no-progress"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--workload", "nope"], "no workload named 'nope'"),
        (["--peer", "nope"], "unknown peer engine"),
        (["--speculative-config", "{method: ngram}"], "not valid JSON"),
        (["--speculative-config", '{"method": "no_such_method"}'], "no_such_method"),
        (["--concurrency", "0"], "at least 1"),
        (["--passes", "0"], "pass --passes 1 or more"),
    ],
)
def test_mistakes_fail_before_anything_runs(tiny_model: Path, capsys: pytest.CaptureFixture[str], extra: list[str],
                                            message: str) -> None:
    assert main(["bench", "offline", str(tiny_model), *SMALL, *extra]) == 2
    assert message in capsys.readouterr().err


def test_url_and_speculative_configs_do_not_mix(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["bench", "serve", str(tiny_model), "--url", "http://127.0.0.1:9", "--speculative-config", NGRAM])
    assert code == 2
    assert "--url benchmarks a server that is already running" in capsys.readouterr().err


def test_a_running_server_is_measured_in_one_pass(tiny_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", str(tiny_model), "--url", "http://127.0.0.1:9", "--passes", "2"]) == 2
    assert "--url benchmarks a running server once" in capsys.readouterr().err


def test_offline_rows_side_by_side(tiny_model: Path, fake_peer: object, tmp_path: Path,
                                   capsys: pytest.CaptureFixture[str]) -> None:
    out_json, out_md = tmp_path / "b.json", tmp_path / "b.md"
    code = main([
        "bench", "offline", str(tiny_model), *SMALL, "--dtype", "float32", "--speculative-config", NGRAM,
        "--peer", "fake:echo", "--json", str(out_json), "--markdown", str(out_md),
    ])
    assert code == 0
    printed = capsys.readouterr().out
    assert "| sonar ngram k=3" in printed and "| fake echo k=4" in printed
    (table,) = json.loads(out_json.read_text())["tables"]
    rows = {row["label"]: row for row in table["rows"]}
    assert list(rows) == ["sonar", "sonar ngram k=3 n=1..3", "fake", "fake echo k=4"]
    plain, ngram = rows["sonar"], rows["sonar ngram k=3 n=1..3"]
    for row in rows.values():
        figures = row["figures"]
        assert figures["num_requests"] == 2 and figures["output_tokens"] > 0
        assert figures["ttft"]["count"] == 2 and figures["peak_rss_bytes"] > 0
    # Greedy speculation is lossless: the ngram row reproduces the plain row token for token.
    assert ngram["figures"]["match_plain"] == 1.0
    assert plain["figures"]["kv_cache_bytes"] > 0
    assert plain["precision"] == "float32"
    # The fake peer repeats the prompt: it does not match Sonar, and its acceptance comes through.
    fake = rows["fake echo k=4"]["figures"]
    assert fake["match_sonar"] == 0.0
    assert fake["acceptance"]["per_position"] == [1.0, 1.0]
    assert fake["tokens_per_step"] == pytest.approx(3.0, rel=0.5)
    assert rows["fake"]["figures"]["speedup"] == pytest.approx(1.0)
    assert "| sonar ngram k=3" in out_md.read_text()


def test_a_suite_writes_one_report(tiny_model: Path, fake_peer: object, tmp_path: Path) -> None:
    suite = tmp_path / "mini.json"
    suite.write_text(json.dumps({
        "description": "Mini report",
        "runs": [{"title": "Chat", "args": ["offline", str(tiny_model), "--workload", "chat", *SMALL, "--peer", "fake"]}],
    }))
    assert main(["bench", "suite", str(suite), "--out", str(tmp_path / "out"), "--no-progress"]) == 0
    report = (tmp_path / "out" / "mini.md").read_text()
    assert report.startswith("# Mini report") and "### Chat" in report
    assert f"Command: `aphrodite bench offline {tiny_model} --workload chat" in report
    (table,) = json.loads((tmp_path / "out" / "mini.json").read_text())["tables"]
    assert [row["label"] for row in table["rows"]] == ["sonar", "fake"]


def test_an_unknown_suite_names_the_shipped_ones(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "suite", "nope"]) == 2
    assert "performance" in capsys.readouterr().err
