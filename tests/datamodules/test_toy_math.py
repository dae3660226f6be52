"""The toy visual-math world (core/toy_math, datamodules/toy_math.py): deterministic splits written as reasoning rows,
every answer re-derived from the pixels by an independent reader, and follow-ups whose answers stay exact."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from scipy import ndimage

from core.coevolution import BRIDGE
from core.math_grading import answers_match
from core.toy.grammar import COLOURS
from core.toy_math import KINDS, FollowUp, ToyProblem, follow_up, parse_follow_up, render
from core.toy_math.world import LETTERS
from datamodules.reasoning import read_rows
from datamodules.toy_math import SPLITS, export_split, follow_up_row, main, make_row, row_answer


def _answer_from_pixels(row) -> str:
    """The answer read off the image alone (colour masks, connected components, grid lines), checked against nothing
    but the problem's wording and the query's structure."""
    image = np.asarray(row["image"])
    query, scene = row["meta"]["query"], row["meta"]["scene"]

    def mask(colour):
        return (image == np.array(COLOURS[colour])).all(-1)

    def count(colour):
        return ndimage.label(mask(colour))[1]

    op = query["op"]
    if op == "count":
        if query["shape"] is None:  # by colour: connected components of that colour (shapes never touch)
            colours = [query["colour"]] if query["colour"] else [c for c in COLOURS if c not in ("white", "black")]
            return str(sum(count(c) for c in colours))
        return None  # shape queries: checked through the scene below
    if op == "count_diff":
        return str(count(query["a"]) - count(query["b"]))
    if op == "most_choice":
        counts = [count(c) for c in query["options"]]
        return LETTERS[int(np.argmax(counts))]
    # bars: a bar's value is the number of grid lines at or below its top edge
    grid_x = next(x for x in range(image.shape[1]) if (image[:, x] == 200).all(-1).sum() >= scene["max_value"])
    grid_ys = np.flatnonzero((image[:, grid_x] == 200).all(-1))
    values = {}
    for bar in scene["bars"]:
        top = np.flatnonzero(mask(bar["colour"]).any(1))[0]
        values[bar["colour"]] = int((grid_ys >= top).sum())
    if op == "bar_value":
        return str(values[query["colour"]])
    if op == "bar_total":
        return str(sum(values.values()))
    return str(max(values.values()) - min(values.values()))


@pytest.mark.parametrize("split", list(SPLITS))
def test_answers_are_what_the_pixels_show(split):
    kinds = Counter()
    for i in range(48):
        row = make_row(split, i, seed=3)
        kinds[row["meta"]["query"]["op"]] += 1
        assert row_answer(row) == row["answer"]  # the meta re-derives the answer
        if row["meta"]["follow_ups"]:
            continue
        from_pixels = _answer_from_pixels(row)
        if from_pixels is not None:
            assert from_pixels == row["answer"], (split, i, row["problem"])
    assert set(kinds) == set(KINDS)  # every kind appears (count_diff / most_choice may fall back to count)


def test_splits_are_deterministic_prefixes_and_differ():
    a = make_row("train", 5, seed=0)
    b = make_row("train", 5, seed=0)
    assert a["problem"] == b["problem"] and a["answer"] == b["answer"]
    assert np.array_equal(np.asarray(a["image"]), np.asarray(b["image"]))  # same bytes
    assert make_row("val", 5, seed=0)["meta"]["scene"] != a["meta"]["scene"]  # splits never share scenes
    assert make_row("train", 5, seed=1)["meta"]["scene"] != a["meta"]["scene"]
    ood = [make_row("ood", i, seed=0) for i in range(36)]
    assert sum(bool(r["meta"]["follow_ups"]) for r in ood) >= 6  # about half of the numeric ones are composed
    shapes = [len(r["meta"]["scene"]["objects"]) for r in ood if r["meta"]["scene"]["kind"] == "shapes"]
    assert min(shapes) >= 9  # busier than train's 3-8
    with pytest.raises(ValueError, match="unknown toy math split"):
        make_row("test", 0, seed=0)


def test_export_is_read_by_the_reasoning_reader(tmp_path):
    path = export_split(tmp_path, "val", 12, seed=0)
    again = export_split(tmp_path, "val", 12, seed=0)  # idempotent: the manifest says it is there
    assert again == path
    records = read_rows(path)
    assert [r.sample_id for r in records] == [f"toymath-val-s0-{i:06d}" for i in range(12)]
    for rec in records:
        assert rec.image_path.is_file() and rec.image_path.parent == tmp_path / "images"
        assert row_answer({"meta": rec.meta}) == rec.answer  # the meta survives the round trip
    assert main(["--out", str(tmp_path / "cli"), "--splits", "train:3"]) == [tmp_path / "cli" / "train.jsonl"]


def test_follow_ups_compose_the_seed_form_with_exact_answers():
    scene = {"kind": "bars", "size": 224, "max_value": 6,
             "bars": [{"colour": "red", "value": 4}, {"colour": "blue", "value": 2}]}  # fmt: skip
    base = ToyProblem.base(scene, {"op": "bar_value", "colour": "red"})
    assert base.answer == 4
    once = follow_up(base, FollowUp("add", 3))
    assert once.text == f"{base.text}\n\n{BRIDGE}\nWhat is x + 3?"
    assert once.answer == 7
    twice = follow_up(once, "What is x squared?")  # a text in the toy grammar
    assert twice.answer == 49 and twice.text.startswith(once.text)
    assert [f.op for f in twice.follow_ups] == ["add", "square"]
    assert follow_up(base, FollowUp("rsub", 10)).answer == 6
    assert follow_up(base, FollowUp("mul", 3)).answer == 12
    assert follow_up(base, FollowUp("sub", 5)).answer == -1
    with pytest.raises(ValueError, match="not a toy follow-up"):
        follow_up(base, "What is the colour of x?")
    choice = ToyProblem({"op": "most_choice", "options": ["red"]}, "Which?", "A")
    with pytest.raises(ValueError, match="only a numeric answer"):
        follow_up(choice, FollowUp("add", 1))
    with pytest.raises(ValueError, match="follow-up op"):
        FollowUp("divide", 2)


def test_follow_up_row_stays_checkable_round_after_round():
    row = make_row("train", 0, seed=0)  # "How many orange shapes ...?" -> 4
    edited = follow_up_row(follow_up_row(row, "What is 3x?"), FollowUp("sub", 2))
    assert edited["id"] == row["id"] and edited["image"] is row["image"]
    assert edited["answer"] == str(int(row["answer"]) * 3 - 2) == row_answer(edited)
    assert edited["problem"].count(BRIDGE) == 2 and edited["problem"].startswith(row["problem"])
    assert answers_match(edited["answer"], row_answer(edited))


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("What is x + 3?", FollowUp("add", 3)),
        ("Compute 3 + x.", FollowUp("add", 3)),
        ("What is x - 12?", FollowUp("sub", 12)),
        ("What is 4 times x?", FollowUp("mul", 4)),
        ("Find 4x", FollowUp("mul", 4)),
        ("What is x * 4?", FollowUp("mul", 4)),
        ("$15 - x$", FollowUp("rsub", 15)),
        ("What is x squared?", FollowUp("square")),
        ("x^2", FollowUp("square")),
        ("What is the value of x + 1?", FollowUp("add", 1)),
        ("What is x / 2?", None),
        ("How many red shapes are there?", None),
        ("", None),
        (None, None),
        ("x + " + "9" * 300, None),
    ],
)
def test_parse_follow_up(text, expected):
    assert parse_follow_up(text) == expected
    if expected is not None:
        assert parse_follow_up(expected.text()) == expected  # the canonical text reads back


def test_render_is_a_pure_function_of_the_scene():
    row = make_row("ood", 3, seed=0)
    assert np.array_equal(np.asarray(render(row["meta"]["scene"])), np.asarray(row["image"]))
