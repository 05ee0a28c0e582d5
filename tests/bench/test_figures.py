"""The seven figures and the ratios, from hand-made timings."""

from __future__ import annotations

import math

import pytest

from sonar_core.bench.figures import (
    Acceptance,
    Distribution,
    inter_token_gaps,
    match_rate,
    prefix_agreement,
    row_figures,
)
from sonar_core.bench.peers.peer_protocol import RequestRecord, RunResult, SpecCounts
from sonar_core.bench.results import RowResult, compare
from sonar_core.bench.rows import RowSpec


def _result(records: list[RequestRecord], spec: SpecCounts | None = None, seconds: float = 2.0) -> RunResult:
    return RunResult(
        engine_version="t", precision="float32", requests=records, started=0.0, finished=seconds,
        peak_rss_bytes=100 << 20, rss_after_load_bytes=None, kv_cache_bytes=8 << 20, spec=spec,
    )


def test_percentiles_interpolate_like_numpy() -> None:
    dist = Distribution.of([4.0, 1.0, 3.0, 2.0, 5.0])
    assert (dist.p50, dist.p90, dist.mean, dist.count) == (3.0, pytest.approx(4.6), 3.0, 5)
    assert math.isnan(Distribution.of([]).p50)


def test_a_step_of_several_tokens_shares_its_gap() -> None:
    record = RequestRecord("r", 0.0, events=[(0.1, 1), (0.3, 4), (0.4, 1)])
    assert inter_token_gaps(record) == pytest.approx([0.05] * 4 + [0.1])


def test_row_figures() -> None:
    records = [
        RequestRecord("a", 0.0, events=[(0.2, 1), (0.4, 2), (0.5, 1)], token_ids=[1, 2, 3, 4]),
        RequestRecord("b", 1.0, events=[(1.4, 1), (1.6, 1)], token_ids=[5, 6]),
    ]
    figures = row_figures(_result(records, SpecCounts(2, 6, 3, [2, 1, 0])))
    assert figures.ttft.p50 == pytest.approx(0.3)  # 0.2 and 0.4
    assert figures.e2e.p50 == pytest.approx(0.55)  # 0.5 and 0.6
    assert figures.output_tokens == 6
    assert figures.request_throughput == pytest.approx(1.0)
    assert figures.output_throughput == pytest.approx(3.0)
    assert figures.tokens_per_step == pytest.approx(4 / 3)  # 2+1+1 tokens over 3 decode steps
    assert figures.acceptance == Acceptance(2.5, 0.5, [1.0, 0.5, 0.0])  # 1 + 3 accepted / 2 drafts
    assert figures.kv_cache_bytes == 8 << 20


def test_draft_cost_is_proposer_time_over_target_time() -> None:
    result = _result([RequestRecord("a", 0.0, events=[(0.2, 1)])], SpecCounts(1, 3, 1, [1, 0, 0]))
    assert row_figures(result).draft_cost is None  # a peer, or a row without speculation
    result.target_seconds, result.propose_seconds = 2.0, 0.25
    assert row_figures(result).draft_cost == pytest.approx(0.125)


def test_no_drafts_means_no_acceptance_figures() -> None:
    assert Acceptance.of(SpecCounts(0, 0, 0, [0, 0])) is None


def test_match_rate_and_prefix_agreement() -> None:
    reference = [RequestRecord("a", 0, token_ids=[1, 2, 3, 4]), RequestRecord("b", 0, token_ids=[5, 6])]
    mine = [RequestRecord("a", 0, token_ids=[1, 2, 9, 9]), RequestRecord("b", 0, token_ids=[5, 6])]
    assert match_rate(mine, reference) == 0.5
    assert prefix_agreement(mine, reference) == pytest.approx((0.5 + 1.0) / 2)
    texts = [RequestRecord("a", 0, text="same")]
    assert match_rate(texts, [RequestRecord("a", 0, text="same")]) == 1.0


def test_compare_relates_each_row_to_its_plain_row_and_to_sonar() -> None:
    def row(engine: str, method: str | None, seconds: float, tokens: list[int]) -> RowResult:
        result = _result([RequestRecord("a", 0.0, events=[(0.1, len(tokens))], token_ids=tokens)], seconds=seconds)
        return RowResult(RowSpec(engine, method), 1, float("inf"), result, row_figures(result))

    rows = [
        row("sonar", None, 2.0, [1, 2, 3, 4]),
        row("sonar", "ngram", 1.0, [1, 2, 3, 4]),
        row("hf", None, 4.0, [1, 2, 3, 4]),
        row("hf", "prompt_lookup", 2.0, [1, 2, 3, 5]),
        RowResult(RowSpec("vllm", None), 1, float("inf"), skipped="not installed"),
    ]
    compare(rows)
    sonar_plain, sonar_ngram, hf_plain, hf_lookup, vllm = rows
    assert sonar_ngram.figures.speedup == pytest.approx(2.0)
    assert sonar_ngram.figures.match_plain == 1.0
    assert hf_plain.figures.vs_sonar == pytest.approx(0.5)
    assert hf_lookup.figures.speedup == pytest.approx(2.0)
    assert hf_lookup.figures.vs_sonar == pytest.approx(1.0)
    assert hf_lookup.figures.match_plain == 0.0
    assert hf_lookup.figures.prefix_agreement_sonar == pytest.approx(0.75)
    assert sonar_plain.figures.speedup == pytest.approx(1.0)
    assert vllm.figures is None
