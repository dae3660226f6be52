"""The co-evolution edits' shared parts (core/coevolution.py): the seeded edit partition and the follow-up
composition."""

from __future__ import annotations

import pytest

from core.coevolution import BRIDGE, compose_follow_up, edit_draw, edit_kind


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
