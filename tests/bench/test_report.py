"""Tables, JSON and metrics parsing."""

from __future__ import annotations

import json
import math

from sonar_core.bench.figures import row_figures
from sonar_core.bench.peers.peer_protocol import RequestRecord, RunResult, SpecCounts
from sonar_core.bench.prometheus import parse_metrics
from sonar_core.bench.report import COLUMNS, TableMeta, render, to_json
from sonar_core.bench.results import RowResult, compare
from sonar_core.bench.rows import RowSpec


def _rows() -> list[RowResult]:
    def measured(engine: str, method: str | None, spec: SpecCounts | None) -> RowResult:
        result = RunResult(
            engine_version="v", precision="bfloat16",
            requests=[RequestRecord("a", 0.0, events=[(0.05, 1), (0.1, 2)], token_ids=[1, 2, 3])],
            started=0.0, finished=0.2, peak_rss_bytes=300 << 20, rss_after_load_bytes=None,
            kv_cache_bytes=64 << 20, spec=spec, notes=["a note"],
        )
        return RowResult(RowSpec(engine, method, {"num_speculative_tokens": 2} if method else {}), 1, float("inf"),
                         result, row_figures(result))

    rows = [
        measured("sonar", None, None),
        measured("sonar", "ngram", SpecCounts(1, 2, 1, [1, 0])),
        RowResult(RowSpec("vllm", None), 1, float("inf"), skipped="not installed (bash scripts/peers/vllm_cpu.sh)"),
    ]
    compare(rows)
    return rows


def _meta() -> TableMeta:
    return TableMeta(title="T", workload="chat", num_prompts=1, max_tokens=8, threads=2,
                     request_rate=float("inf"), command="aphrodite bench offline", load_before=(0.5, 0.4, 0.3),
                     load_after=(0.6, 0.5, 0.4))


def test_the_table_shows_every_figure_and_the_skipped_rows() -> None:
    text = render(_meta(), _rows())
    header = next(line for line in text.splitlines() if line.startswith("| row"))
    assert all(column in header for column in COLUMNS)
    ngram = next(line for line in text.splitlines() if line.startswith("| sonar ngram k=2"))
    cells = [cell.strip() for cell in ngram.strip("|").split("|")]
    assert cells[COLUMNS.index("accept len")] == "2.00"  # 1 + 1 accepted / 1 draft
    assert cells[COLUMNS.index("accept by position")] == "1.00 0.00"
    assert cells[COLUMNS.index("speedup")] == "1.00x"
    assert cells[COLUMNS.index("= plain")] == "100%"
    assert cells[COLUMNS.index("KV MiB")] == "64"
    assert "vllm: not run: not installed (bash scripts/peers/vllm_cpu.sh)" in text
    assert "Load average" in text


def test_json_holds_every_number_and_no_nan() -> None:
    data = to_json(_meta(), _rows())
    text = json.dumps(data, allow_nan=False)  # raises on NaN or infinity
    rows = json.loads(text)["rows"]
    assert rows[1]["figures"]["acceptance"]["per_position"] == [1.0, 0.0]
    assert rows[1]["requests"][0]["output_tokens"] == 3
    assert rows[2]["skipped"].startswith("not installed")
    assert data["meta"]["request_rate"] is None


def test_spec_counters_from_prometheus_text() -> None:
    text = """
# TYPE aphrodite:spec_decode_num_drafts counter
aphrodite:spec_decode_num_drafts_total{model_name="m"} 10.0
# TYPE aphrodite:spec_decode_num_draft_tokens counter
aphrodite:spec_decode_num_draft_tokens_total{model_name="m"} 30.0
# TYPE aphrodite:spec_decode_num_accepted_tokens counter
aphrodite:spec_decode_num_accepted_tokens_total{model_name="m"} 12.0
# TYPE aphrodite:spec_decode_num_accepted_tokens_per_pos counter
aphrodite:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 4.0
aphrodite:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="0"} 8.0
# TYPE process_resident_memory_bytes gauge
process_resident_memory_bytes 1.5e+08
"""
    snapshot = parse_metrics(text)
    assert snapshot.spec == SpecCounts(10, 30, 12, [8, 4])
    assert snapshot.resident_memory_bytes == 150_000_000
    assert parse_metrics("").spec is None
    assert not math.isnan(snapshot.resident_memory_bytes)


def _cells(text: str, label: str) -> list[str]:
    line = next(line for line in text.splitlines() if line.startswith(f"| {label} "))
    return [cell.strip() for cell in line.strip("|").split("|")]


def test_a_row_measured_under_load_marks_every_ratio_it_takes_part_in() -> None:
    rows = _rows()
    rows[0].other_cpu = 0.9  # the plain row ran while other work kept most of a core busy
    compare(rows)
    text = render(_meta(), rows)
    assert _cells(text, "sonar ngram k=2")[COLUMNS.index("speedup")] == "1.00x?"
    assert _cells(text, "sonar")[COLUMNS.index("vs Sonar")] == "1.00x?"
    assert "sonar: unreliable: other work kept 0.9 cores busy while it ran" in text


def test_passes_that_disagree_mark_the_row_and_a_quiet_one_is_not_marked() -> None:
    rows = _rows()
    rows[1].pass_throughputs = [10.0, 14.0]
    compare(rows)
    text = render(_meta(), rows)
    assert _cells(text, "sonar ngram k=2")[COLUMNS.index("speedup")] == "1.00x?"
    assert "its passes differ by 40%" in text
    assert _cells(text, "sonar")[COLUMNS.index("speedup")] == "1.00x"


def test_outputs_that_differ_from_plain_are_explained_under_the_table() -> None:
    rows = _rows()
    assert "= plain: the share of requests" not in render(_meta(), rows)
    rows[1].result.requests[0].token_ids = [1, 2, 4]
    compare(rows)
    text = render(_meta(), rows)
    assert _cells(text, "sonar ngram k=2")[COLUMNS.index("= plain")] == "0%"
    assert "= plain: the share of requests whose output equals the plain row's token for token" in text
