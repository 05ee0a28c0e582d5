"""``aphrodite bench startup``: fresh processes, three figures, a table."""

from __future__ import annotations

from sonar_core.bench.startup import measure, render


def test_startup_times_the_engine_and_a_configuration_error(tiny_model):
    figures = measure(str(tiny_model), repeats=1)
    assert [f.label.split(" (")[0] for f in figures] == ["engine ready", "LLM() constructor alone", "config error"]
    ready, constructor, error = (f.seconds[0] for f in figures)
    assert 0 < constructor < ready and error > 0
    table = render(figures, str(tiny_model))
    assert "| engine ready (process start to LLM() returning)" in table and "median s" in table
