"""The draft-tree bound: ranks of the right token along an EAGLE-3 head's branch, and the engine-like
walk that scores a tree shape from them."""

from __future__ import annotations

import pytest
import torch
from training_kit import DEPTH, draft_eagle3_chain, make_trainer

from sonar_core.errors import ConfigError
from sonar_core.training.dataset import TrainingSequence
from sonar_core.training.tree_bound import (
    NOT_DRAFTABLE,
    main,
    parse_trees,
    right_token_ranks,
    score_tree,
    tree_nodes,
)


def test_a_tree_drafts_the_product_of_its_widths_at_each_depth():
    assert tree_nodes((1, 1, 1)) == 3
    assert tree_nodes((3, 2, 1)) == 3 + 6 + 6
    assert tree_nodes((4, 2, 2, 1, 1)) == 4 + 8 + 16 + 16 + 16
    assert parse_trees("1,1,1; 3,2,1") == [(1, 1, 1), (3, 2, 1)]
    with pytest.raises(ValueError, match="positive widths"):
        parse_trees("3,0,1")


def test_the_walk_scores_the_steps_the_engine_would_take_not_every_position():
    ranks = torch.tensor([
        [0, 0, 5],  # step 1: accepts two drafts, so the next step starts three positions on
        [1, 0, 0],  # skipped by a chain; where the first step accepts nothing, a wider tree takes it
        [0, 9, 9],
        [0, 0, 0],  # step 2: accepts all three
        [NOT_DRAFTABLE, 0, 0],
        [0, 0, 0],
        [0, 0, 0],
        [4, 0, 0],  # step 3: nothing
    ])
    chain = score_tree([ranks], (1, 1, 1))
    assert chain.reach == (2 / 3, 2 / 3, 1 / 3)
    assert chain.mean_acceptance_length == pytest.approx(1 + 5 / 3)
    shallow = score_tree([ranks], (1,))  # steps at 0, 2, 4, 5, 7: accepted 1, 1, 0, 1, 0
    assert shallow.reach == (3 / 5,)
    wide = score_tree([ranks[1:]], (2, 1, 1))  # from row 1: accepts three, then from row 5 three more
    assert wide.reach == (1.0, 1.0, 1.0)
    with pytest.raises(ValueError, match="widths"):
        score_tree([ranks], (1, 1, 1, 1))


def test_ranks_follow_the_heads_own_chain_and_its_runners_up(tmp_path, dataset, training_target):
    """Along the chain the head drafts itself every rank is 0; a runner-up in its place ranks 1; a
    token outside the draft vocabulary is never drafted."""
    chain = draft_eagle3_chain(tmp_path / "head", training_target, dataset)
    head, vocab_map, record, m, drafts = chain.head, chain.vocab_map, chain.record, chain.m, chain.drafts
    runner_up = int(vocab_map.to_target(chain.recorded[DEPTH - 1].topk(2, dim=-1).indices[0, 1:]))
    outside = next(t for t in range(training_target.vocab_size) if t not in set(vocab_map.target_ids.tolist()))

    def ranks_with(last_draft: int) -> list[int]:
        tokens = torch.cat([record.token_ids[: m + 1], torch.tensor(drafts[:-1] + [last_draft])])
        aux = torch.cat([record.aux[:m], torch.zeros(DEPTH, record.aux.shape[1])])
        sequence = TrainingSequence(tokens, aux, None)
        # Prompt length m: the one scored position is row m - 1, the step after token m.
        (ranks,) = right_token_ranks(head, vocab_map, [(sequence, m)], DEPTH)
        assert ranks.shape == (1, DEPTH)
        return ranks[0].tolist()

    assert ranks_with(drafts[-1]) == [0, 0, 0]
    assert ranks_with(runner_up) == [0, 0, 1]
    assert ranks_with(outside) == [0, 0, NOT_DRAFTABLE]


def test_the_command_scores_tree_shapes_of_a_trained_head(tmp_path, dataset, training_target, target, capsys):
    trainer = make_trainer("eagle3", training_target, dataset, depth=DEPTH, seed=3)
    head_dir = trainer.export(tmp_path / "head", torch.float32)
    costs = ",".join(str(1 + rows / 10) for rows in range(8))
    main([str(target), "--head", str(head_dir), "--workload", "chat", "--num-prompts", "2", "--max-tokens", "12",
          "--dtype", "float32", "--trees", "1,1;2,1;2,2", "--row-costs", costs])
    printed = capsys.readouterr().out
    assert "chat: 2 greedy answers" in printed
    rows = [line.split(" | ") for line in printed.splitlines() if line.startswith("| 1,1 ") or line.startswith("| 2,")]
    assert [row[0] for row in rows] == ["| 1,1", "| 2,1", "| 2,2"]
    assert [int(row[1]) for row in rows] == [2, 4, 6]
    lengths = [float(row[3]) for row in rows]
    assert all(1.0 <= length <= 3.0 for length in lengths)


def test_without_a_head_the_command_takes_the_shipped_one_and_names_the_fix_where_none_ships(target):
    with pytest.raises(ConfigError, match="no EAGLE-3 head ships for this target") as raised:
        main([str(target), "--workload", "chat", "--num-prompts", "1"])
    assert raised.value.field == "head" and "--head" in str(raised.value)
