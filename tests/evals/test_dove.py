"""DOVE's scores by hand: the judge's reply read as an option or N/M, TEC per probe type and macro, N/M, the group
bootstrap, and the reader's errors (evals/dove.py)."""

from __future__ import annotations

import json

import pytest

from core.records import DataError
from evals.dove import Probe, judge_prompt, read_choice, read_dove, summarize_dove
from tests.evals.video_bench_fixtures import write_dove_fixture


def test_read_choice():
    assert read_choice("B", 4) == 1
    assert read_choice("The answer is C.", 4) == 2
    assert read_choice("N/M", 4) == "nm" and read_choice("not mentioned (A?)", 4) == "nm"
    assert read_choice("E", 4) is None  # not one of four options
    assert read_choice("I cannot tell", 4) is None and read_choice(None, 4) is None


def test_judge_prompt_letters_the_options():
    p = Probe("order", "Which move is this?", ["the first", "the second"], 1)
    text = judge_prompt("the second time the large circle moves", p)
    assert "Description: the second time the large circle moves\n" in text
    assert "A. the first\nB. the second\n" in text and text.endswith("or N/M.")


def _row(group, kind, choice, answer):
    return {"group": group, "type": kind, "choice": choice, "correct": choice == answer}


def test_tec_and_nm_by_hand():
    # order: 1 of 2 right (0.5); state: 1 of 1 (1.0); outcome: 0 of 1, answered N/M (0.0) -> TEC = 1.5 / 3 = 0.5;
    # N/M 1 of 4 probes; the unreadable reply counts as wrong and as unreadable
    rows = [
        _row("g0", "order", 0, 0),
        _row("g1", "order", None, 1),
        _row("g0", "state", 2, 2),
        _row("g1", "outcome", "nm", 3),
    ]
    m = summarize_dove(rows, bootstrap=200)
    assert m["tec_by_type"] == {"order": 0.5, "state": 1.0, "outcome": 0.0}
    assert m["tec"] == 0.5 and m["nm"] == 0.25 and m["unreadable"] == 0.25 and m["n_probes"] == 4
    assert m["probes_by_type"] == {"order": 2, "state": 1, "outcome": 1}
    lo, hi = m["tec_ci95"]
    assert lo <= m["tec"] <= hi  # resampling groups g0 (all right) and g1 (all wrong)
    # a type without probes is left out of the macro average, not counted as 0
    assert summarize_dove([_row("g0", "state", 1, 1)])["tec"] == 1.0


def test_read_dove_and_its_errors(tmp_path):
    path, _, groups = write_dove_fixture(tmp_path)
    got = read_dove(path)
    assert [o.occurrence_id for o in got[0].occurrences] == [o["id"] for o in groups[0]["occurrences"]]
    assert [p.type for p in got[0].occurrences[0].probes] == ["order", "state", "outcome"]
    bad = json.loads(path.read_text().splitlines()[0])
    bad["occurrences"][1]["probes"][2]["type"] = "colour"
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(DataError, match=r"dove.jsonl:1: occurrence 1, probe 2: probe type 'colour'"):
        read_dove(path)
    bad["occurrences"][1]["probes"][2].update(type="outcome", answer="B")  # a letter is read as its index
    path.write_text(json.dumps(bad) + "\n")
    assert read_dove(path)[0].occurrences[1].probes[2].answer == 1
    bad["occurrences"][1]["interval"] = [3.0, 2.0]
    path.write_text(json.dumps(bad) + "\n")
    with pytest.raises(DataError, match=r"occurrence 1: interval \[3.0, 2.0\] is not \[start, end\]"):
        read_dove(path)
