"""The third-party example plugin (examples/sonar-example-plugin): its proposer, and that it installs
with pip and is found through its entry point."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from sonar_core.spec_decode.proposer import ProposalRequest, ProposeBatch

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "sonar-example-plugin"


@pytest.fixture(scope="module")
def bigram_module():
    sys.path.insert(0, str(EXAMPLE / "src"))
    from sonar_example_plugin import proposer

    yield proposer
    sys.path.remove(str(EXAMPLE / "src"))


def step(proposer, request_id, tokens, budget=4, new=None):
    request = ProposalRequest(request_id=request_id, token_ids=tokens, num_new_tokens=new or len(tokens),
                              max_draft_tokens=budget, block_table=[0])
    batch = ProposeBatch(requests=[request], block_size=16, kv_caches=[], device=None)
    return proposer.propose(batch).token_ids[0]


def test_bigram_follows_the_most_frequent_successor(bigram_module):
    proposer = bigram_module.BigramProposer()
    proposer.add_request("r", [1, 2, 3, 1, 2, 3, 1])
    assert step(proposer, "r", [1, 2, 3, 1, 2, 3, 1]) == [2, 3, 1, 2]
    assert step(proposer, "r", [1, 2, 3, 1, 2, 3, 1], budget=0) == []


def test_bigram_learns_accepted_tokens_incrementally(bigram_module):
    proposer = bigram_module.BigramProposer()
    proposer.add_request("r", [5, 6])
    assert step(proposer, "r", [5, 6]) == []  # 6 has no successor yet
    assert step(proposer, "r", [5, 6, 9, 6], new=2) == [9, 6, 9, 6]  # learned 6 -> 9 and 9 -> 6
    assert proposer._tables["r"].counts == {(5, 6): 1, (6, 9): 1, (9, 6): 1}


def test_bigram_min_count_and_ties(bigram_module):
    proposer = bigram_module.BigramProposer(min_count=2)
    tokens = [1, 2, 1, 3, 1, 3, 1]
    proposer.add_request("r", tokens)
    assert step(proposer, "r", tokens, budget=2) == [3, 1]  # 1 -> 3 seen twice, 1 -> 2 once
    tie = bigram_module.BigramTable()
    tie.learn([4, 5, 4, 6])
    assert tie.follow(4, 1, 1) == [6]  # equal counts: the most recent successor


def test_bigram_tables_per_request_or_shared(bigram_module):
    separate = bigram_module.BigramProposer()
    separate.add_request("a", [7, 8])
    separate.add_request("b", [7])
    step(separate, "a", [7, 8])
    assert step(separate, "b", [7]) == []
    shared = bigram_module.BigramProposer(share_across_requests=True)
    shared.add_request("a", [7, 8])
    shared.add_request("b", [7])
    step(shared, "a", [7, 8])
    assert step(shared, "b", [7], budget=1) == [8]
    shared.remove_request("a")
    assert "a" not in shared._tables


@pytest.fixture(scope="module")
def installed_example(tmp_path_factory):
    """pip-install a copy of the example (so that no build files land in the repository)."""
    source = tmp_path_factory.mktemp("example") / "sonar-example-plugin"
    shutil.copytree(EXAMPLE, source, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    target = tmp_path_factory.mktemp("site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps",
         "--no-build-isolation", "--target", str(target), str(source)],
        check=True,
    )
    return target


def test_installed_example_is_listed_by_aphrodite_plugins(run_aphrodite, installed_example):
    result = run_aphrodite("plugins", env={"PYTHONPATH": str(installed_example), "SONAR_PLUGINS": "bigram"})
    assert result.returncode == 0, result.stderr
    row = next(line for line in result.stdout.splitlines() if line.startswith("bigram"))
    assert row.split()[:4] == ["bigram", "bigram_table", "sonar-example-plugin", "0.1.0"]


def test_installed_example_validates_its_options_and_rules(run_aphrodite, installed_example, make_model_dir):
    model = str(make_model_dir())
    env = {"PYTHONPATH": str(installed_example), "SONAR_PLUGINS": "bigram"}
    ok = run_aphrodite("serve", model, "--check-config", "--speculative-config",
                       '{"method": "bigram_table", "num_speculative_tokens": 3, "min_count": 2}', env=env)
    assert ok.returncode == 0, ok.stderr
    typo = run_aphrodite("serve", model, "--check-config", "--speculative-config",
                         '{"method": "bigram", "num_speculative_tokens": 3, "min_cuont": 2}', env=env)
    assert typo.returncode == 2 and "did you mean 'min_count'?" in typo.stderr
    checkpoint = run_aphrodite("serve", model, "--check-config", "--speculative-config",
                               '{"method": "bigram", "num_speculative_tokens": 3, "model": "x"}', env=env)
    assert checkpoint.returncode == 2 and "speculative_config.model" in checkpoint.stderr
