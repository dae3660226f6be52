"""V-STaR's scores by hand: tIoU, the per-item box mIoU, the judge's 0-3 rating, AM / LGM per chain and mAM / mLGM,
the two bbox layouts of the annotation file, and V-STaR's own result files as predictions
(evals/vstar.py)."""

from __future__ import annotations

import json
import math

import pytest

from core.records import DataError
from evals.vstar import (
    evaluate_vstar,
    exact_rating,
    parse_interval,
    parse_rating,
    parse_timed_boxes,
    read_vstar,
    read_vstar_predictions,
    spatial_miou,
    summarize_vstar,
    temporal_iou,
    vstar_questions,
)
from tests.evals.video_bench_fixtures import write_vstar_fixture


def test_temporal_iou_and_interval_answers():
    # [2, 6] vs [4, 8]: overlap 2 s over the hull 6 s
    assert temporal_iou((2.0, 6.0), (4.0, 8.0)) == pytest.approx(1 / 3)
    assert temporal_iou((2.0, 6.0), (7.0, 9.0)) == 0.0  # disjoint
    assert temporal_iou((2.0, 6.0), None) == 0.0  # unreadable
    # V-STaR reads an interval only from exactly two numbers (of the answer part when tagged)
    assert parse_interval("<think>maybe 3</think><answer>[4.0, 5.5]</answer>") == (4.0, 5.5)
    assert parse_interval("from 1 to 2, or 3") is None
    assert parse_interval("<answer>no target</answer>") is None


def test_timed_boxes_scaled_to_the_video_and_their_miou():
    # V-STaR's JSON answer, in a 56 x 56 model frame of a 112 x 112 video: every coordinate doubles
    got = parse_timed_boxes('```json\n{"4": [0, 0, 5, 5], "5": [[1, 1, 2, 2]]}\n```', (56, 56), (112, 112))
    assert got == {4.0: [(0.0, 0.0, 10.0, 10.0)], 5.0: [(2.0, 2.0, 4.0, 4.0)]}
    # the toy checkpoint's anchors; a list of per-second objects
    assert parse_timed_boxes("<answer>4.0s: [0, 0, 10, 10]; 4.5s: [1, 1, 3, 3]</answer>") == {
        4.0: [(0.0, 0.0, 10.0, 10.0)],
        4.5: [(1.0, 1.0, 3.0, 3.0)],
    }
    assert parse_timed_boxes('[{"4": [0, 0, 10, 10]}, {"6": [0, 0, 1, 1]}]') == {
        4.0: [(0.0, 0.0, 10.0, 10.0)],
        6.0: [(0.0, 0.0, 1.0, 1.0)],
    }
    assert parse_timed_boxes("no target") == {}
    # ground truth at 4 s and 5 s; at 4 s the best of two boxes is exact (IoU 1), nothing at 5 s (0), the box at
    # 6 s is on no annotated frame: (1 + 0) / 2
    gt = [(4.0, (0.0, 0.0, 10.0, 10.0)), (5.0, (0.0, 0.0, 10.0, 10.0))]
    pred = {4.0: [(50.0, 50.0, 60.0, 60.0), (0.0, 0.0, 10.0, 10.0)], 6.0: [(0.0, 0.0, 10.0, 10.0)]}
    assert spatial_miou(gt, pred) == 0.5
    assert spatial_miou(gt, {4.0: [(0.0, 0.0, 5.0, 10.0)]}) == 0.25  # half the box at 4 s, nothing at 5 s
    assert spatial_miou(gt, {}) == 0.0


def test_what_ratings():
    assert [parse_rating(r) for r in ("2", " 3\n", "Rating: 1", "5", "I think 2", None)] == [2, 3, 1, -1, -1, -1]
    assert exact_rating("<answer>The large circle.</answer>", "the large circle") == 3
    assert exact_rating("a small circle", "the large circle") == 0
    assert exact_rating(None, "x") == 0


def _row(rating, when, where, where_2, when_2, domain="a"):
    return {
        "rating": rating,
        "when_iou": when,
        "where_iou": where,
        "where_2_iou": where_2,
        "when_2_iou": when_2,
        "domain": domain,
        "duration_class": "Short",
    }


def test_am_and_lgm_by_hand():
    # ratings 3 and 1 -> acc 0.5 (a rating of -1 counts as 0 in avg_rating); chain 1: when (0.5 + 0) / 2 = 0.25,
    # where (0.5 + 0.5) / 2 = 0.5; chain 2: where_2 (1 + 0) / 2 = 0.5, when_2 0
    m = summarize_vstar([_row(3, 0.5, 0.5, 1.0, 0.0), _row(1, 0.0, 0.5, 0.0, 0.0, domain="b")])
    assert m["acc"] == 0.5 and m["avg_rating"] == 2.0
    assert (m["when"], m["where"], m["where_2"], m["when_2"]) == (0.25, 0.5, 0.5, 0.0)
    assert m["when_r1@0.3"] == 0.5 and m["when_r1@0.7"] == 0.0
    assert m["AM1"] == pytest.approx((0.5 + 0.25 + 0.5) / 3)
    assert m["AM2"] == pytest.approx((0.5 + 0.0 + 0.5) / 3)
    assert m["LGM1"] == pytest.approx(-(math.log(0.5) + math.log(0.75) + math.log(0.5)) / 3)  # 0.5580
    assert m["LGM2"] == pytest.approx(-(2 * math.log(0.5)) / 3)  # 0.4621
    assert m["mAM"] == pytest.approx(0.375) and m["mLGM"] == pytest.approx((m["LGM1"] + m["LGM2"]) / 2)
    assert m["by_domain"]["b"]["acc"] == 0.0 and m["by_duration"]["Short"]["n"] == 2
    # a perfect score would make LGM infinite: 1 - x is clipped at 1e-6
    perfect = summarize_vstar([_row(3, 1.0, 1.0, 1.0, 1.0)])
    assert perfect["mAM"] == 1.0 and perfect["mLGM"] == pytest.approx(-math.log(1e-6))


def test_read_vstar_both_bbox_layouts_and_its_questions(tmp_path):
    path, _, clips = write_vstar_fixture(tmp_path)
    items = read_vstar(path)
    assert [it.sample_id for it in items] == [f"{c['id']}#{i}" for i, c in enumerate(clips)]
    for it, c in zip(items, clips):  # item 0 in eval.py's layout, item 1 in the data README's: same boxes
        assert it.boxes == [(float(t), tuple(float(v) for v in b)) for t, b in c["anchors"]]
        assert it.timestamps == tuple(c["solution"][0]) and it.duration == 8.0 and it.duration_class == "Short"
    q = vstar_questions(items[0], "vstar")  # ground truth [4, 6] s: whole seconds 4, 5, 6
    assert "[4, 5, 6]" in q["where"] and '{"4": [x1, y1, x2, y2]' in q["where"]
    assert "8.0 seconds long with a resolution of 112x112" in q["when_2"] and "[[48, 34, 69, 55]" in q["when_2"]
    assert vstar_questions(items[0], "toy")["when"] == "When: " + clips[0]["meta"]["query"]
    raw = json.loads(path.read_text())
    del raw[1]["timestamps"]
    path.write_text(json.dumps(raw))
    with pytest.raises(DataError, match=r"vstar.json: item 1: missing \['timestamps'\]"):
        read_vstar(path)


def test_vstar_result_files_score_as_predictions(tmp_path):
    # V-STaR's own inference output: the annotation list with parsed answers added, boxes already in video pixels
    path, _, clips = write_vstar_fixture(tmp_path)
    items = read_vstar(path)
    raw = json.loads(path.read_text())
    t0, t1 = clips[0]["solution"][0]
    (ta, box_a) = clips[0]["anchors"][0]
    raw[0].update(
        answer_vqa=raw[0]["answer"],  # exact match: rating 3
        answer_temporal=[t0, t1],  # tIoU 1
        answer_spatial={f"{ta:g}": box_a},  # the first of the item's boxes exact: mIoU 1 / n_boxes
        answer_spatial_2=None,
        answer_temporal_2=[t1, t1 + 2],  # touches the end: tIoU 0
    )
    raw[1].update(answer_vqa="no idea", answer_temporal=[], answer_spatial=None)
    result_file = tmp_path / "model_answer.json"
    result_file.write_text(json.dumps(raw))
    res = evaluate_vstar(items, tmp_path / "out" / "r.json", predictions=read_vstar_predictions(result_file))
    rows = [json.loads(line) for line in (tmp_path / "out" / "r.predictions.jsonl").read_text().splitlines()]
    n_boxes = len(clips[0]["anchors"])
    assert (rows[0]["rating"], rows[0]["when_iou"], rows[0]["when_2_iou"]) == (3, 1.0, 0.0)
    assert rows[0]["where_iou"] == pytest.approx(1 / n_boxes) and rows[0]["where_2_iou"] == 0.0
    assert (rows[1]["rating"], rows[1]["when_iou"], rows[1]["where_iou"]) == (0, 0.0, 0.0)
    m = res["metrics"]
    assert res["what_scorer"] == "exact" and m["acc"] == 0.5 and m["when"] == 0.5
    assert m["AM1"] == pytest.approx((0.5 + 0.5 + 0.5 / n_boxes) / 3)


def test_load_clip_samples_an_mp4_at_the_asked_rate(tmp_path):
    cv2 = pytest.importorskip("cv2")
    import numpy as np

    from evals.video_inputs import VideoIndex, load_clip

    path = tmp_path / "sub" / "vid7.mp4"
    path.parent.mkdir()
    writer = cv2.VideoWriter(str(path), cv2.VideoWriter_fourcc(*"mp4v"), 4.0, (64, 48))
    for i in range(12):  # 3 s at 4 fps; frame i is a flat grey of 20 * i
        writer.write(np.full((48, 64, 3), 20 * i, dtype=np.uint8))
    writer.release()
    assert VideoIndex(tmp_path).path("vid7", "here") == path  # found in a subfolder by its stem
    grey = lambda clip: [int(np.asarray(f).mean()) for f in clip.frames]  # noqa: E731
    clip = load_clip(path, fps=2.0)  # every other frame: 0, 40, ..., 200 (give or take the codec)
    assert (len(clip.frames), clip.fps, clip.size) == (6, 2.0, (64, 48))
    assert grey(clip) == pytest.approx([0, 40, 80, 120, 160, 200], abs=6)
    # at most 4 frames: evenly spaced every 0.75 s (frames 0, 3, 6, 9), scaled down under 32 x 24 pixels
    clip = load_clip(path, fps=4.0, max_frames=4, max_pixels=32 * 24)
    assert len(clip.frames) == 4 and clip.fps == pytest.approx(4 / 3) and clip.size == (32, 28)  # 28: the floor
    assert grey(clip) == pytest.approx([0, 60, 120, 180], abs=6)


def test_what_rated_by_a_judge_server(tmp_path):
    pytest.importorskip("fastapi")
    from lightning_modules.judge import JudgeClient, JudgeConfig
    from tests.judge_server import running_judge_server

    path, _, _ = write_vstar_fixture(tmp_path)
    items = read_vstar(path)
    preds = {
        it.sample_id: {"completions": {"what": answer}, "input_wh": None}
        for it, answer in zip(items, ["the big round one", "<answer>a square</answer>"])
    }
    # the judge rates 2 when the candidate mentions "round", else 1; it sees the question, reference and candidate
    with running_judge_server(script=lambda p: "2" if "Candidate answer: the big round one" in p else "1") as judge:
        client = JudgeClient(JudgeConfig(base_url=judge.url + "/scripted/v1", trust_env=False))
        res = evaluate_vstar(items, tmp_path / "r.json", predictions=preds, judge=client)
        prompts = [b["messages"][-1]["content"] for b in judge.state.requests]
    assert res["what_scorer"] == "judge" and res["metrics"]["acc"] == 0.5 and res["metrics"]["avg_rating"] == 1.5
    assert any(f"Groundtruth answer: {items[0].answer}" in p and items[0].question in p for p in prompts)
    assert any("Candidate answer: a square\n" in p for p in prompts)  # the answer part, tags dropped
