"""Training-side inputs that used to crash or mislead (issue #13, item 6): JSONL defects named by file and line,
the OVD reward's cost bounded on a runaway completion."""

from __future__ import annotations

import json
import warnings

import pytest

from core.records import DataError
from core.rewards import MAX_PRED_BOXES, ovd_reward
from datamodules.rec import read_jsonl


def _line(i: int) -> str:
    return json.dumps({"id": f"s{i}", "image": "a.png", "problem": "the cat", "solution": [1, 2, 30, 40]})


def test_a_non_utf8_line_names_its_file_line_and_column(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes((_line(0) + "\n").encode() + b'{"id": "caf\xe9", "image": "a.png"}\n')
    with pytest.raises(DataError) as e:
        read_jsonl(path)
    msg = str(e.value)
    assert f"{path}:2:" in msg and "not UTF-8" in msg and "column 12" in msg and "iconv" in msg


def test_json_error_column_is_on_the_line_itself(tmp_path):
    path = tmp_path / "train.jsonl"
    bad = '{"id": "s1", "image": "a.png",'  # cut after the comma: the error is at its end, column len + 1
    path.write_text(_line(0) + "\n" + bad + "\n")
    with pytest.raises(DataError) as e:
        read_jsonl(path)
    assert f"{path}:2: not valid JSON" in str(e.value) and f"at column {len(bad) + 1})" in str(e.value)
    path.write_text(_line(0) + "\r\n" + '{"id": x}' + "\r\n")  # CRLF lines: the column is still the character's
    with pytest.raises(DataError, match=r":2: not valid JSON \(Expecting value at column 8\)"):
        read_jsonl(path)


def test_a_utf8_bom_on_the_first_line_is_accepted(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + (_line(0) + "\n" + _line(1) + "\n").encode())
    assert [r.sample_id for r in read_jsonl(path)] == ["s0", "s1"]


def test_ovd_reward_scores_at_most_maxdets_boxes_with_the_same_value():
    gt = [[0, 0, 10, 10], [20, 20, 40, 40], [50, 50, 60, 70]]
    # 150 boxes: junk first, the three GT boxes at ranks 40, 90 and 130 (the last one beyond COCO's maxDets = 100)
    boxes = [[70 + i % 7, 70, 80 + i % 7, 90] for i in range(150)]
    boxes[40], boxes[90], boxes[130] = gt
    text = "<answer>" + json.dumps(boxes) + "</answer>"
    capped = ovd_reward([text], [gt])[0]
    uncapped = ovd_reward([text], [gt], max_pred_boxes=10**6)[0]
    assert capped == pytest.approx(uncapped) and 0 < capped < 3 / 150  # s_ovd counts all 150 boxes
    # a runaway completion (~11k boxes, ~150k characters): the metric sees MAX_PRED_BOXES, so no "more than 100
    # detections" warning and a bounded cost
    many = (
        "<answer>" + ",".join(f"[{i % 50},{i % 40},{i % 50 + 10},{i % 40 + 10}]" for i in range(11_000)) + "</answer>"
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = ovd_reward([many], [gt])[0]
    assert 0 <= r <= 3 / 11_000 and MAX_PRED_BOXES == 100
