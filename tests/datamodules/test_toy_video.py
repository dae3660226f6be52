"""Tests for datamodules/toy_video.py: labels recomputed from the rendered pixels, determinism, unambiguous queries,
export and the Qwen2.5-VL video input."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from core.regions import AnchorSpace, IntervalSpace
from core.toy.grammar import COLOURS
from datamodules import toy_video
from datamodules.toy_video import (
    DIRECTIONS,
    export_jsonl,
    load_frames,
    make_clip,
    qwen_video_kwargs,
    render_frames,
    resolve_query,
)

REPO = Path(__file__).resolve().parents[2]
N_CLIPS = 40


@pytest.fixture(scope="module")
def clips():
    return [make_clip("train", i, seed=0) for i in range(N_CLIPS)]


def _pixel_box(frame: np.ndarray, colour: str):
    """Tight box [x1, y1, x2, y2] (pixels x1 <= x < x2) of the pixels of exactly this colour, or None."""
    hit = np.all(frame == np.array(COLOURS[colour], dtype=np.uint8), axis=-1)
    if not hit.any():
        return None
    rows, cols = np.flatnonzero(hit.any(axis=1)), np.flatnonzero(hit.any(axis=0))
    return [int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1]


def _detected_moves(frames: list[np.ndarray], colours: list[str]) -> list[dict]:
    """The actor's moves recovered from the pixels alone: runs of frames whose box differs from the frame before."""
    boxes = [_pixel_box(f, c) for f, c in zip(frames, colours)]
    changed = [i for i in range(1, len(boxes)) if boxes[i] != boxes[i - 1]]
    runs: list[list[int]] = []
    for i in changed:
        if runs and i == runs[-1][-1] + 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    moves = []
    for run in runs:
        s, e = run[0] - 1, run[-1]
        dx, dy = boxes[e][0] - boxes[s][0], boxes[e][1] - boxes[s][1]
        direction = next(d for d, (ux, uy) in DIRECTIONS.items() if (np.sign(dx), np.sign(dy)) == (ux, uy))
        moves.append({"type": "move", "object": 0, "start_frame": s, "end_frame": e, "direction": direction,
                      "colour": colours[s]})  # fmt: skip
    return moves


def test_boxes_are_the_drawn_pixels(clips):
    for clip in clips:
        frames = [np.asarray(f) for f in clip["frames"]]
        assert len(frames) == 16 and frames[0].shape == (112, 112, 3)
        for obj in clip["meta"]["objects"]:
            for f, frame in enumerate(frames):
                expected = obj["boxes"][f]
                assert _pixel_box(frame, obj["colours"][f]) == (None if expected is None else list(expected))


def test_intervals_and_anchors_recomputed_from_pixels(clips):
    """Find the actor's moves in the frames, resolve the query over them, and get the label back."""
    fps = 2.0
    for clip in clips:
        meta = clip["meta"]
        actor = meta["objects"][0]
        frames = [np.asarray(f) for f in clip["frames"]]
        detected = _detected_moves(frames, actor["colours"])
        labelled = [ev for ev in meta["events"] if ev["type"] == "move" and ev["object"] == 0]
        assert detected == labelled
        hits = resolve_query(meta["query_spec"], {"objects": meta["objects"], "events": detected})
        if not clip["solution"]:
            assert hits == [] and clip["anchors"] == []
            continue
        assert len(hits) == 1
        s, e = detected[hits[0]]["start_frame"], detected[hits[0]]["end_frame"]
        assert clip["solution"] == [[s / fps, e / fps]]
        assert clip["anchors"] == [[f / fps, _pixel_box(frames[f], actor["colours"][f])] for f in range(s, e + 1)]
        assert s % 2 == 0 and e % 2 == 0  # on Qwen2.5-VL's temporal patch boundaries
        others = [[m["start_frame"] / fps, m["end_frame"] / fps] for i, m in enumerate(detected) if i != hits[0]]
        assert clip["lookalikes"] == others and len(others) >= 1


def test_queries_are_unambiguous_and_other_cues_are_not(clips):
    modes = Counter()
    for clip in clips:
        meta, q = clip["meta"], clip["meta"]["query_spec"]
        hits = resolve_query(q, meta)
        if not clip["solution"]:
            assert hits == []
            modes["no_target"] += 1
            continue
        modes[q["mode"]] += 1
        assert hits == [meta["target_event"]]
        target = meta["events"][meta["target_event"]]
        moves = [ev for ev in meta["events"] if ev["type"] == "move" and ev["object"] == 0]
        assert len(moves) >= 2  # a repeated event: "the <actor> moves" alone never singles it out
        same_direction = [ev for ev in moves if ev["direction"] == target["direction"]]
        same_colour = [ev for ev in moves if ev["colour"] == target["colour"]]
        if q["mode"] == "order":  # neither outcome nor state tells the moves apart
            assert len(same_direction) == len(same_colour) == len(moves)
        elif q["mode"] == "outcome":  # the state does not; the direction does
            assert len(same_colour) == len(moves) and same_direction == [target]
        else:  # the outcome does not; the colour does
            assert len(same_direction) == len(moves) and same_colour == [target]
        # the other objects never look like the actor (other shapes, colours the actor never wears)
        actor = meta["objects"][0]
        for obj in meta["objects"][1:]:
            assert obj["shape"] != actor["shape"] and not set(obj["colours"]) & set(actor["colours"])
    assert set(modes) == {"order", "outcome", "state", "no_target"}, modes


def test_labels_parse_with_the_region_spaces(clips):
    for clip in clips:
        space = IntervalSpace(duration=clip["duration"])
        answer = space.parse(clip["conversations"][1]["value"])
        gt = clip["solution"] or []
        assert space.consistency(gt, answer) == 1.0
        anchors = AnchorSpace(tau=3.0)
        assert anchors.consistency(clip["anchors"], anchors.parse(clip["anchors_text"])) == 1.0


def test_determinism_per_seed_split_and_index():
    a, b = make_clip("val", 3, seed=7), make_clip("val", 3, seed=7)
    assert a["meta"] == b["meta"]
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(a["frames"], b["frames"]))
    assert make_clip("val", 3, seed=8)["meta"] != a["meta"]
    assert make_clip("train", 3, seed=7)["meta"] != a["meta"]
    # frames are a function of meta alone
    assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(render_frames(a["meta"]), a["frames"]))


def test_argument_errors_name_the_flag():
    with pytest.raises(ValueError, match="unknown split 'dev'"):
        make_clip("dev", 0, 0)
    with pytest.raises(ValueError, match="--size must be a multiple of 28"):
        make_clip("train", 0, 0, size=100)
    with pytest.raises(ValueError, match="--num_frames must be even"):
        make_clip("train", 0, 0, num_frames=15)


def test_export_round_trip_and_cli(tmp_path):
    path = export_jsonl(tmp_path, "train", 3, seed=0)
    assert path == tmp_path / "train_video.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["id"] for r in records] == ["toyvid-train-000000", "toyvid-train-000001", "toyvid-train-000002"]
    for rec in records:
        clip = make_clip("train", rec["meta"]["index"], 0)
        frames = load_frames(rec, root=tmp_path)
        assert all(np.array_equal(np.asarray(x), np.asarray(y)) for x, y in zip(frames, clip["frames"]))
        assert rec["solution"] == clip["solution"] and rec["fps"] == 2.0 and rec["duration"] == 8.0
    mtime = path.stat().st_mtime_ns
    assert toy_video.main(["--out", str(tmp_path), "--splits", "train:3"]) == [path]
    assert path.stat().st_mtime_ns == mtime  # same parameters: reused, not rewritten


def test_qwen_video_input_keeps_fps_and_size():
    model_dir = REPO / "checkpoints" / "toy-qwen2.5-vl"
    if not (model_dir / "processor_config.json").exists():
        pytest.skip("the toy checkpoint's processor is not in this checkout")
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(model_dir)
    clip = make_clip("train", 0, 0)
    text = "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>" + clip["meta"]["query"] + "<|im_end|>\n"
    out = processor(text=[text], return_tensors="pt", **qwen_video_kwargs(clip))
    # 16 frames of 112 px: 8 temporal patches of 2 frames, 8 x 8 patches of 14 px; 2 x 2 merge -> 8 * 16 tokens
    assert out["video_grid_thw"].tolist() == [[8, 8, 8]]
    assert float(out["second_per_grid_ts"][0]) == 1.0  # 2 frames / 2 fps (transformers' default would be 2 / 24)
    video_pad = processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert int((out["input_ids"] == video_pad).sum()) == 128
