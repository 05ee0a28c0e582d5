"""Acceptance counters, the periodic log line and the Prometheus counters against hand counts."""

import logging

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from sonar_core.spec_decode.metrics import (
    SpecDecodingLogging,
    SpecDecodingProm,
    SpecDecodingStats,
    guide_name_exposition,
)

# (drafted, accepted) per request-step, num_speculative_tokens = 3. By hand: 4 drafts, 11 draft
# tokens, 6 accepted; position 0 accepted in 3 drafts, position 1 in 2, position 2 in 1.
STEPS = [(3, 3), (3, 1), (2, 0), (3, 2)]


def _stats(steps: list[tuple[int, int]] = STEPS) -> SpecDecodingStats:
    stats = SpecDecodingStats(num_speculative_tokens=3)
    for drafted, accepted in steps:
        stats.observe_draft(drafted, accepted)
    return stats


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_counts_and_summary() -> None:
    stats = _stats()
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (4, 11, 6)
    assert stats.num_accepted_tokens_per_pos == [3, 2, 1]
    summary = stats.summary()
    assert summary.mean_acceptance_length == pytest.approx(1 + 6 / 4)
    assert summary.acceptance_rate == pytest.approx(6 / 11)
    assert summary.per_position_acceptance_rate == pytest.approx([0.75, 0.5, 0.25])
    assert (summary.num_drafts, summary.num_draft_tokens, summary.num_accepted_tokens) == (4, 11, 6)


def test_steps_without_drafts_are_not_drafts() -> None:
    stats = _stats([(0, 0), (2, 1)])
    assert (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) == (1, 2, 1)
    empty = SpecDecodingStats(num_speculative_tokens=2).summary()
    assert empty.mean_acceptance_length == 1.0 and empty.acceptance_rate == 0.0
    assert empty.per_position_acceptance_rate == [0.0, 0.0]


@pytest.mark.parametrize(("drafted", "accepted"), [(4, 1), (2, 3), (1, -1)])
def test_impossible_counts_are_rejected(drafted: int, accepted: int) -> None:
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        SpecDecodingStats(num_speculative_tokens=3).observe_draft(drafted, accepted)


def test_add_folds_counts() -> None:
    total = _stats(STEPS[:2])
    total.add(_stats(STEPS[2:]))
    assert total == _stats()
    with pytest.raises(ValueError, match="positions"):
        total.add(SpecDecodingStats(num_speculative_tokens=2))


def test_log_line_is_exact(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    logging_ = SpecDecodingLogging(num_speculative_tokens=3, interval_s=5.0, clock=clock)
    logging_.observe(_stats())
    clock.now += 2.0
    with caplog.at_level(logging.INFO, logger="sonar.spec_decode"):
        line = logging_.log()
    expected = (
        "SpecDecoding metrics: Mean acceptance length: 2.50, Accepted throughput: 3.00 tokens/s, "
        "Drafted throughput: 5.50 tokens/s, Accepted: 6 tokens, Drafted: 11 tokens, "
        "Per-position acceptance rate: 0.750, 0.500, 0.250, Avg Draft acceptance rate: 54.5%"
    )
    assert line == expected
    assert [(r.name, r.getMessage()) for r in caplog.records] == [("sonar.spec_decode", expected)]


def test_periodic_logging_respects_the_interval_and_resets(caplog: pytest.LogCaptureFixture) -> None:
    clock = FakeClock()
    logging_ = SpecDecodingLogging(num_speculative_tokens=3, interval_s=5.0, clock=clock)
    with caplog.at_level(logging.INFO, logger="sonar.spec_decode"):
        clock.now += 10.0
        assert logging_.maybe_log() is None  # no drafts yet: nothing to say, the interval restarts
        logging_.observe(_stats())
        clock.now += 1.0
        assert logging_.maybe_log() is None  # 1 s since the quiet interval ended
        clock.now += 4.0
        first = logging_.maybe_log()  # 5 s: the drafts are measured over these 5 s, not 15
        assert first is not None and "Accepted throughput: 1.20 tokens/s" in first
        logging_.observe(_stats([(2, 2)]))
        clock.now += 4.0
        assert logging_.maybe_log() is None  # 4 s since the last line
        clock.now += 4.0
        line = logging_.maybe_log()
    # Only the (2, 2) draft is in the second interval, over 8 s.
    assert line is not None
    assert "Mean acceptance length: 3.00, Accepted throughput: 0.25 tokens/s" in line
    assert "Drafted throughput: 0.25 tokens/s, Accepted: 2 tokens, Drafted: 2 tokens" in line
    assert "Per-position acceptance rate: 1.000, 1.000, 0.000, Avg Draft acceptance rate: 100.0%" in line
    assert len(caplog.records) == 2


def _scrape(registry: CollectorRegistry) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    samples = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def test_prometheus_counters_and_documented_formulas() -> None:
    registry = CollectorRegistry()
    prom = SpecDecodingProm(num_speculative_tokens=3, model_name="tiny", registry=registry)
    prom.observe(_stats(STEPS[:1]))
    prom.observe(_stats(STEPS[1:]))
    scraped = _scrape(registry)
    label = (("model_name", "tiny"),)
    drafts = scraped[("aphrodite:spec_decode_num_drafts_total", label)]
    draft_tokens = scraped[("aphrodite:spec_decode_num_draft_tokens_total", label)]
    accepted = scraped[("aphrodite:spec_decode_num_accepted_tokens_total", label)]
    assert (drafts, draft_tokens, accepted) == (4, 11, 6)
    per_pos = [
        scraped[("aphrodite:spec_decode_num_accepted_tokens_per_pos_total", (("model_name", "tiny"), ("position", str(j))))]
        for j in range(3)
    ]
    assert per_pos == [3, 2, 1]
    # The documentation's PromQL: accepted_total / draft_tokens_total and 1 + accepted_total / num_drafts_total.
    assert accepted / draft_tokens == pytest.approx(6 / 11)
    assert 1 + accepted / drafts == pytest.approx(2.5)


def test_the_guides_query_without_total_finds_the_same_counts() -> None:
    """The guide divides by ``aphrodite:spec_decode_num_drafts`` (no ``_total``): /metrics carries
    every spec-decode counter under both names, with the same values and labels."""
    registry = CollectorRegistry()
    SpecDecodingProm(num_speculative_tokens=3, model_name="tiny", registry=registry).observe(_stats(STEPS))
    text = (generate_latest(registry) + guide_name_exposition(registry)).decode()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    for name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        key = (("model_name", "tiny"),)
        assert samples[(f"aphrodite:spec_decode_{name}", key)] == samples[(f"aphrodite:spec_decode_{name}_total", key)]
    per_pos = (("model_name", "tiny"), ("position", "1"))
    assert samples[("aphrodite:spec_decode_num_accepted_tokens_per_pos", per_pos)] == 2
    assert 1 + samples[("aphrodite:spec_decode_num_accepted_tokens", (("model_name", "tiny"),))] / samples[
        ("aphrodite:spec_decode_num_drafts", (("model_name", "tiny"),))
    ] == pytest.approx(2.5)


def test_counters_are_shared_per_registry_and_labelled_per_model() -> None:
    registry = CollectorRegistry()
    first = SpecDecodingProm(num_speculative_tokens=3, model_name="a", registry=registry)
    second = SpecDecodingProm(num_speculative_tokens=3, model_name="b", registry=registry)
    first.observe(_stats())
    second.observe(_stats([(1, 1)]))
    scraped = _scrape(registry)
    assert scraped[("aphrodite:spec_decode_num_drafts_total", (("model_name", "a"),))] == 4
    assert scraped[("aphrodite:spec_decode_num_drafts_total", (("model_name", "b"),))] == 1
    # Positions exist (at 0) before they first accept.
    key = ("aphrodite:spec_decode_num_accepted_tokens_per_pos_total", (("model_name", "b"), ("position", "2")))
    assert scraped[key] == 0
    with pytest.raises(ValueError, match="positions"):
        first.observe(SpecDecodingStats(num_speculative_tokens=2))


def _repeating_prompts() -> list[list[int]]:
    return [[5, 9, 12, 40, 7] * 6, list(range(20, 40)) * 2]


def test_the_python_api_logs_the_line_when_asked_and_not_by_default(target_dir, tmp_path, caplog) -> None:
    from aphrodite import LLM, SamplingParams
    from sonar_core.testing.losslessness import constant_distribution_target

    # A target that always says the same token: its output repeats, so the lookup drafts.
    target_dir = constant_distribution_target(target_dir, tmp_path / "constant")
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    with caplog.at_level(logging.INFO, logger="sonar.spec_decode"):
        LLM(model=str(target_dir), dtype="float32", speculative_config=config).generate(_repeating_prompts(), params)
    assert not [r for r in caplog.records if "SpecDecoding metrics" in r.getMessage()]  # vLLM's default

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="sonar.spec_decode"):
        llm = LLM(model=str(target_dir), dtype="float32", speculative_config=config, disable_log_stats=False)
        llm.generate(_repeating_prompts(), params, use_tqdm=False)
    lines = [r.getMessage() for r in caplog.records if "SpecDecoding metrics" in r.getMessage()]
    # The interval has not passed in so short a run: the line comes at the end of generate().
    assert len(lines) == 1
    summary = llm.get_spec_decode_metrics()
    assert f"Accepted: {summary.num_accepted_tokens} tokens, Drafted: {summary.num_draft_tokens} tokens" in lines[0]
