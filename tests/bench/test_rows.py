"""Rows from the command line: Sonar configurations, peer specs, draft checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

from sonar_core.bench.rows import RowSpec, parse_peer, peer_rows, sonar_rows, with_draft, with_heads
from sonar_core.errors import ConfigError


def test_sonar_rows_start_with_the_plain_row() -> None:
    rows = sonar_rows(['{"method": "ngram", "num_speculative_tokens": 4}', {"method": "suffix"}])
    assert [r.label for r in rows] == ["sonar", "sonar ngram k=4", "sonar suffix"]
    assert rows[0].is_plain and rows[1].options == {"method": "ngram", "num_speculative_tokens": 4}


def test_ngram_rows_with_match_lengths_are_told_apart() -> None:
    rows = sonar_rows(
        [
            '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 2, "prompt_lookup_max": 5}',
            '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3}',
        ],
        include_plain=False,
    )
    assert [r.label for r in rows] == ["sonar ngram k=5 n=2..5", "sonar ngram k=5 n=3..3"]
    assert parse_peer('vllm:ngram={"prompt_lookup_min": 1, "prompt_lookup_max": 4}').label == "vllm ngram k=4 n=1..4"


@pytest.mark.parametrize(("value", "message"), [("{bad", "not valid JSON"), ('{"num_speculative_tokens": 2}', "names no method")])
def test_bad_sonar_configs_are_config_errors(value: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        sonar_rows([value])


def test_peer_specs() -> None:
    assert parse_peer("hf") == RowSpec("hf", None)
    lookup = parse_peer('hf:prompt_lookup={"num_speculative_tokens": 6}')
    assert (lookup.method, lookup.options, lookup.label) == ("prompt_lookup", {"num_speculative_tokens": 6}, "hf prompt_lookup k=6")
    assert parse_peer("vllm:ngram").options == {"num_speculative_tokens": 4}  # the default depth
    assert parse_peer("llama_cpp").label == "llama.cpp"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("nope", "unknown peer engine"),
        ("hf:ngram", "hf:prompt_lookup"),
        ('vllm:ngram={"depth": 3}', "does not take depth"),
        ("hf:assistant={oops", "not valid JSON"),
    ],
)
def test_bad_peer_specs_name_the_choices(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        parse_peer(text)


def test_each_peer_gets_its_plain_row_first_once() -> None:
    rows = peer_rows(["hf:prompt_lookup", "vllm", "hf", "hf:assistant"])
    assert [(r.engine, r.method) for r in rows] == [
        ("hf", None), ("hf", "prompt_lookup"), ("hf", "assistant"), ("vllm", None),
    ]


def test_draft_rows_get_the_truncated_draft(tmp_path: Path) -> None:
    rows = [RowSpec("sonar", "draft_model", {"method": "draft_model"}), RowSpec("hf", "assistant", {"model": "/mine"})]
    filled = with_draft(rows, [tmp_path / "first8layers", tmp_path / "first16layers"])
    assert [row.label for row in filled] == [
        "sonar draft_model (first8layers)", "sonar draft_model (first16layers)", "hf assistant (mine)",
    ]
    assert filled[0].options["model"] == str(tmp_path / "first8layers")
    assert filled[2].options["model"] == "/mine"  # a named draft is kept
    with pytest.raises(ConfigError, match="--truncated-draft"):
        with_draft(rows[:1], [])


def test_head_rows_get_a_head_or_say_how_to(tmp_path: Path) -> None:
    rows = [
        RowSpec("sonar", "eagle3", {"method": "eagle3", "num_speculative_tokens": 3}),
        RowSpec("sonar", "eagle", {"method": "eagle", "model": "/trained/head"}),
        RowSpec("sonar", "ngram", {"method": "ngram"}),
    ]
    filled = with_heads(rows, lambda method: tmp_path / f"random-{method}")
    assert [row.label for row in filled] == ["sonar eagle3 k=3 (random-eagle3)", "sonar eagle (head)", "sonar ngram"]
    # Without --random-heads the row keeps no model: a head the target ships, or the plugin's error.
    assert with_heads(rows[:1], None) == rows[:1]


def test_mtp_rows_run_on_a_target_copy_with_random_layers_only_when_asked(tmp_path: Path) -> None:
    rows = [RowSpec("sonar", "mtp", {"method": "mtp", "num_speculative_tokens": 2})]
    filled = with_heads(rows, lambda method: tmp_path / f"random-{method}")
    assert filled[0].target_dir == str(tmp_path / "random-mtp")
    assert filled[0].label == "sonar mtp k=2 (random-mtp)"
    assert with_heads(rows, None)[0].target_dir is None  # a target with its own MTP layers


def test_a_head_row_without_a_head_for_a_target_that_ships_none_says_how_to_get_one(tiny_model: Path) -> None:
    from sonar_core.bench.session import _check_sonar_row
    from sonar_core.config import EngineConfig

    row = RowSpec("sonar", "eagle3", {"method": "eagle3", "num_speculative_tokens": 3})
    with pytest.raises(ConfigError) as info:
        _check_sonar_row(row, EngineConfig(model=str(tiny_model), device="cpu"))
    assert "aphrodite train-draft" in info.value.fix and "--random-heads" in info.value.fix


def test_rows_that_differ_in_depth_policy_have_distinct_labels():
    fixed, auto = sonar_rows(
        [
            {"method": "ngram", "num_speculative_tokens": 5, "depth_policy": "fixed"},
            {"method": "ngram", "num_speculative_tokens": 5, "depth_policy": "auto"},
        ],
        include_plain=False,
    )
    assert (fixed.label, auto.label) == ("sonar ngram k=5", "sonar ngram k=5 depth=auto")


def test_rows_that_set_a_draft_stop_say_it():
    default, uncut = sonar_rows(
        [
            {"method": "eagle3", "num_speculative_tokens": 3},
            {"method": "eagle3", "num_speculative_tokens": 3, "draft_stop_confidence": 0},
        ],
        include_plain=False,
    )
    assert (default.label, uncut.label) == ("sonar eagle3 k=3", "sonar eagle3 k=3 stop=0")


def test_rows_with_draft_branches_say_how_many_chains():
    """A set count is labelled, 1 included: unset, the engine decides (DraftBranching)."""
    default, chain, branches = sonar_rows(
        [
            {"method": "eagle3", "num_speculative_tokens": 4},
            {"method": "eagle3", "num_speculative_tokens": 4, "num_draft_branches": 1},
            {"method": "eagle3", "num_speculative_tokens": 4, "num_draft_branches": 3},
        ],
        include_plain=False,
    )
    assert (default.label, chain.label, branches.label) == (
        "sonar eagle3 k=4", "sonar eagle3 k=4 x1", "sonar eagle3 k=4 x3"
    )
