"""The lookup depth-bound replay: exact accounting of tokens, verified drafts and cost per policy."""

from __future__ import annotations

import numpy as np

from sonar_core.bench.lookup_bound import (
    OnlineAuto,
    acceptance_by_match_length,
    best_depths,
    main,
    policies,
    replay,
)

# The answer repeats the prompt's first line, then leaves it: lookup drafts the copy right and
# the rest wrong.
PROMPT = list(range(10, 30)) + [7, 8] + list(range(10, 30))
ANSWERS = [(PROMPT, [7, 8, *range(10, 22), 99, 98, 97, 96, 10, 11, 12, 40])]
COSTS = [1.0, 1.1, 1.2, 1.35, 1.5, 1.65]


def _run(name_prefix: str, min_n: int = 2, depth: int = 5):
    chosen = {name: policy for name, policy in policies(ANSWERS, min_n, 5, depth, COSTS).items()
              if name.startswith(name_prefix)}
    (policy,) = chosen.values()
    return replay(ANSWERS, min_n, 5, depth, policy, COSTS)


def test_every_policy_emits_the_whole_answer_and_pays_for_each_verified_row():
    answer_length = len(ANSWERS[0][1])
    for prefix in ("fixed", "auto, one rate", "auto, rates per match", "by match length", "clairvoyant"):
        result = _run(prefix)
        assert result.tokens == answer_length
        assert result.cost >= result.steps  # a step costs at least a decode step
    # Worked by hand: 5 + 5 drafts accepted, then 2 of 5, five steps without a match, and a last
    # draft of 5 of which 1 is accepted (the answer then ends).
    fixed = _run("fixed")
    assert (fixed.tokens, fixed.steps, fixed.verified_drafts) == (22, 9, 20)
    assert abs(fixed.cost - (4 * 1.65 + 5 * 1.0)) < 1e-9


def test_clairvoyant_depth_verifies_only_accepted_drafts_and_leads_where_costs_grow_steadily():
    clairvoyant = _run("clairvoyant")
    assert clairvoyant.verified_drafts == clairvoyant.tokens - clairvoyant.steps
    for prefix in ("fixed", "by match length"):
        assert _run(prefix).modelled_speedup <= clairvoyant.modelled_speedup + 1e-9


def test_acceptance_rates_by_match_length_are_conditional_on_reaching_the_position():
    rates = acceptance_by_match_length(ANSWERS, 2, 5, 5)
    assert rates.shape == (6, 5)
    assert ((rates >= 0) & (rates <= 1)).all()
    assert rates[5, 0] > 0.5  # long matches in the copied stretch are mostly right


def test_best_depth_drafts_everything_sure_and_nothing_hopeless():
    sure, hopeless = np.ones(5), np.zeros(5)
    assert best_depths(np.stack([sure, hopeless]), COSTS) == [5, 0]


def test_the_command_replays_a_workload_with_row_costs_measured_on_the_model(tiny_model, capsys):
    main([str(tiny_model), "--workload", "code_edit", "--num-prompts", "2", "--max-tokens", "12",
          "--dtype", "float32", "--depths", "3", "--context", "8", "--rounds", "2"])
    printed = capsys.readouterr().out
    assert "step cost by rows (1 = a decode step): 1: 1.00, 2: " in printed and ", 4: " in printed
    rows = [line for line in printed.splitlines() if line.startswith("| n=")]
    assert len(rows) == 10  # two lookup ranges x five policies
    assert all(line.rstrip().endswith("x |") for line in rows)


def test_online_auto_learns_which_match_lengths_pay():
    drafts = np.array([1, 2, 3, 4, 5])
    right, wrong = [1, 2, 3, 4, 5, 6], [9, 9, 9, 9, 9, 9]
    by_length = OnlineAuto(5, COSTS, by_match_length=True)
    one_rate = OnlineAuto(5, COSTS, by_match_length=False)
    for _ in range(60):  # long matches copy right, short ones wrong
        for policy in (by_length, one_rate):
            policy(0, 5, drafts, right)
            policy(0, 2, drafts, wrong)
    assert (by_length(0, 5, drafts, right), by_length(0, 2, drafts, wrong)) == (5, 0)
    assert one_rate(0, 5, drafts, right) == one_rate(0, 2, drafts, wrong)
