"""Tiny V-STaR and DOVE fixtures made from the toy video world (``datamodules/toy_video.py``), with the toy clips'
frames saved as ``<vid>.npz`` (what ``--video-root`` finds): V-STaR's public annotation layout, and the DOVE JSONL this
project defines (``evals/dove.py``). Used by tests/evals/test_vstar.py,
test_dove.py and tests/cli/test_evaluate_video.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from datamodules.toy_video import make_clip, render_frames

ORDINALS = ("the first", "the second", "the third", "the fourth")
DIRECTIONS = ("up", "down", "left", "right")


def _save_frames(rec: dict, videos: Path) -> None:
    videos.mkdir(parents=True, exist_ok=True)
    frames = np.stack([np.asarray(f) for f in render_frames(rec["meta"])])
    np.savez_compressed(videos / f"{rec['id']}.npz", frames=frames)


def toy_clips(n: int, start: int = 0, split: str = "val", seed: int = 0) -> list[dict]:
    """The first ``n`` toy clips of ``split`` from index ``start`` whose query has a target moment."""
    out, index = [], start
    while len(out) < n:
        rec = make_clip(split, index, seed)
        if rec["solution"]:
            out.append(rec)
        index += 1
    return out


def write_vstar_fixture(root: Path, n: int = 2, start: int = 2) -> tuple[Path, Path, list[dict]]:
    """``root/vstar.json`` (V-STaR's annotation layout, one item per toy clip from val index ``start``: the toy
    checkpoint half-finds the first one's moment) and ``root/videos``; returns both paths and the clips. Boxes in
    ``eval.py``'s layout for the first item, the data README's for the others."""
    clips, items = toy_clips(n, start), []
    for i, rec in enumerate(clips):
        _save_frames(rec, root / "videos")
        target = rec["meta"]["objects"][rec["meta"]["events"][rec["meta"]["target_event"]]["object"]]
        query = rec["meta"]["query"]
        if i == 0:
            boxes = [
                {"timestamp": t, "frame_index": int(t * rec["fps"]), **dict(zip(("xmin", "ymin", "xmax", "ymax"), b))}
                for t, b in rec["anchors"]
            ]
        else:
            boxes = [
                {f"{t:g}_{int(t * rec['fps'])}": dict(zip(("xmin", "ymin", "xmax", "ymax"), b))}
                for t, b in rec["anchors"]
            ]
        items.append(
            {
                "vid": rec["id"],
                "domain": "toy",
                "fps": rec["fps"],
                "width": rec["width"],
                "height": rec["height"],
                "frame_count": rec["num_frames"],
                "question": f"Which object is it: {query}?",
                "chain": "<think>...</think>",
                "object": f"the {target['size']} {target['shape']}",
                "answer": f"the {target['size']} {target['shape']}",
                "temporal_question": query,
                "timestamps": rec["solution"][0],
                "spatial_question": query,
                "spatial_question_2": query,
                "bboxes": boxes,
            }
        )
    path = root / "vstar.json"
    path.write_text(json.dumps(items, indent=1), encoding="utf-8")
    return path, root / "videos", clips


def dove_group(rec: dict) -> dict:
    """A contrast group of one toy clip: every move of the queried object is an occurrence, probed for its order
    (which move), its state (the object's colour) and its outcome (the direction it moved)."""
    meta = rec["meta"]
    actor = meta["events"][meta["target_event"]]["object"]
    moves = [e for e in meta["events"] if e["type"] == "move" and e["object"] == actor]
    colours = sorted({c for e in meta["events"] for c in [e.get("colour")] if c} | {"red", "blue"})[:4]
    obj = meta["objects"][actor]
    occurrences = []
    for k, e in enumerate(moves):
        start, end = e["start_frame"] / meta["fps"], e["end_frame"] / meta["fps"]
        probes = [
            {"type": "order", "question": f"Which move of the {obj['size']} {obj['shape']} is this?",
             "options": list(ORDINALS[: max(len(moves), 2)]), "answer": k},
            {"type": "state", "question": "What colour is the object while it moves?",
             "options": colours, "answer": colours.index(e["colour"]) if e.get("colour") in colours else 0},
            {"type": "outcome", "question": "Which way has the object moved by the end?",
             "options": list(DIRECTIONS), "answer": DIRECTIONS.index(e["direction"])},
        ]  # fmt: skip
        occurrences.append({"id": f"{rec['id']}-{k}", "interval": [start, end], "probes": probes})
    query = f"the {obj['size']} {obj['shape']} moves"
    return {"group_id": rec["id"], "video": rec["id"], "query": query, "fps": rec["fps"], "occurrences": occurrences}


def write_dove_fixture(root: Path, n: int = 1) -> tuple[Path, Path, list[dict]]:
    """``root/dove.jsonl`` (one contrast group per toy clip) and ``root/videos``; returns both and the groups."""
    groups = []
    for rec in toy_clips(n):
        _save_frames(rec, root / "videos")
        groups.append(dove_group(rec))
    path = root / "dove.jsonl"
    path.write_text("".join(json.dumps(g) + "\n" for g in groups), encoding="utf-8")
    return path, root / "videos", groups
