"""The co-evolution edits' shared parts (core/coevolution.py): the seeded edit partition and the follow-up
composition."""

from __future__ import annotations

import pytest

from core.coevolution import BRIDGE, compose_follow_up, edit_draw, edit_kind, image_row_count, split_image_rows


def test_the_seeds_partition_takes_an_exact_count_each_round():
    """EvolvedGRPO@2dffc532 data_augmentation/augment_dataset.py, split_rows_for_augmentation: int(n * 0.1 + 0.5)
    rows, at least 1 and at most n - 1, the rows ranked by (sha256("{seed}:{id}").hexdigest(), id)."""
    # n = 64 (toy D_1): int(6.9) = 6 rows (the fixed partition gave 10); 14: int(1.9) = 1; 15: int(2.0) = 2;
    # 2: int(0.7) = 0, raised to 1; 1: at most n - 1 = 0; MMK12's 15,616: 1,562
    assert [image_row_count(n) for n in (0, 1, 2, 14, 15, 64, 15616)] == [0, 0, 1, 1, 2, 6, 1562]
    assert image_row_count(64, 0.0) == 0 and image_row_count(64, 1.0) == 64  # outside the seed's (0, 1): none, all
    ids = [f"row-{i}" for i in range(40)]
    for n in range(1, 41):  # exactly int(0.1 n + 0.5) from n = 5 on
        assert len(split_image_rows(ids[:n], 2026)) == (int(0.1 * n + 0.5) if n >= 5 else min(1, n - 1))
    # a new draw each round (seed 2025 + k), the same for the same seed whatever the order; literal, so it cannot drift
    assert split_image_rows(ids, 2026) == {"row-3", "row-8", "row-28", "row-32"}
    assert split_image_rows(ids, 2027) == {"row-19", "row-21", "row-28", "row-38"}
    assert split_image_rows(reversed(ids), 2026) == split_image_rows(ids, 2026)
    with pytest.raises(ValueError, match="unique"):
        split_image_rows(["a", "a", "b"], 2026)
    with pytest.raises(ValueError, match="image_share"):
        image_row_count(10, 1.5)


def test_partition_is_fixed_by_the_id_and_the_seed():
    ids = [f"mmk12-{i}" for i in range(4000)]
    kinds = [edit_kind(i) for i in ids]
    share = kinds.count("image") / len(kinds)
    assert 0.085 < share < 0.115  # 10% in expectation; 4,000 rows give a standard error of 0.5 points
    assert kinds == [edit_kind(i) for i in ids]  # the same every time (every round)
    assert [edit_kind(i) for i in reversed(ids)] == kinds[::-1]  # no row depends on the others
    assert [edit_kind(i, seed=7) for i in ids] != kinds  # the seed matters
    # literal values, so the partition cannot drift between versions: sha256("2025:row-0") starts c28a18c3e746b44a
    assert edit_draw("row-0") == int("c28a18c3e746b44a", 16) / 2**64
    assert [i for i in range(40) if edit_kind(f"row-{i}") == "image"] == [4, 14, 19, 24, 26]
    assert edit_kind("row-0", image_share=0.0) == "text"
    assert edit_kind("row-0", image_share=1.0) == "image"
    with pytest.raises(ValueError, match="image_share"):
        edit_kind("row-0", image_share=1.5)


def test_compose_follow_up_keeps_the_problem_and_appends_the_bridge():
    composed = compose_follow_up("  How many red shapes are there?  ", " What is x + 3? ")
    assert composed == f"How many red shapes are there?\n\n{BRIDGE}\nWhat is x + 3?"
    assert composed.startswith("How many red shapes are there?")  # the old problem is the prefix
    twice = compose_follow_up(composed, "What is 2x?")  # rounds chain
    assert twice.count(BRIDGE) == 2
    with pytest.raises(ValueError, match="non-empty"):
        compose_follow_up("P", "  ")
