"""The toy ISR rooms (``core.toy.indoor``, ``--data.toy.task isr``): exact boxes, the per-category OVD solution,
the out-of-domain shift, determinism, and the export read back as OVD samples."""

from __future__ import annotations

import numpy as np
import pytest

from core.toy.indoor import CATEGORIES, draw_furniture
from datamodules.rec import read_jsonl
from datamodules.toy import export_jsonl, make_scene


@pytest.mark.parametrize("category", sorted(CATEGORIES))
@pytest.mark.parametrize("box", [[10, 12, 50, 40], [3, 5, 21, 60], [30, 30, 37, 41]])
def test_each_piece_fills_its_box_exactly(category, box):
    """Every category's parts touch all four edges: the drawn pixels' tight box is the box asked for, and nothing is
    drawn outside it (so a scene's label is the drawing's exact extent)."""
    canvas = np.zeros((64, 64, 3), np.uint8)
    mask = np.zeros((64, 64), bool)
    assert draw_furniture(canvas, category, "red", box, mask=mask) == box
    x1, y1, x2, y2 = box
    outside = mask.copy()
    outside[y1:y2, x1:x2] = False
    assert mask[y1:y2, x1:x2].any() and not outside.any() and not canvas[~mask].any()


def test_a_room_asks_for_a_category_and_answers_every_box_of_it():
    for index in range(40):
        rec = make_scene("train", index, 0, 224, "isr")
        meta, query = rec["meta"], rec["meta"]["query"]
        assert query in CATEGORIES and rec["task"] == "ovd" and rec["conversations"][0]["value"] == f"<image>{query}"
        boxes = [o["box"] for o in meta["objects"] if o["category"] == query]
        assert sorted(rec["solution"]) == sorted(boxes) and rec["solution"]
        assert all(o["role"] == ("target" if o["category"] == query else "object") for o in meta["objects"])
        objs = meta["objects"]
        for i, a in enumerate(objs):  # never overlapping
            for b in objs[i + 1 :]:
                ax1, ay1, ax2, ay2 = a["box"]
                bx1, by1, bx2, by2 = b["box"]
                assert ax2 <= bx1 or bx2 <= ax1 or ay2 <= by1 or by2 <= ay1
        image = np.asarray(rec["image"])
        for o in objs:  # each object's colour stands out from its room, and its box edges hold its pixels
            x1, y1, x2, y2 = o["box"]
            assert o["colour"] not in (meta["wall"], meta["floor"])
            inside = image[y1:y2, x1:x2]
            room = np.concatenate([image[: y1 or 1, :].reshape(-1, 3), image[y2:, :].reshape(-1, 3)])
            assert len(np.unique(inside.reshape(-1, 3), axis=0)) > 1 or len(room) == 0


def test_out_of_domain_rooms_are_crowded_and_textured():
    ind = [make_scene("val", i, 0, 224, "isr") for i in range(30)]
    ood = [make_scene("ood", i, 0, 224, "isr") for i in range(30)]
    assert np.mean([len(r["meta"]["objects"]) for r in ood]) > np.mean([len(r["meta"]["objects"]) for r in ind]) + 1.5
    colours = lambda r: len(np.unique(np.asarray(r["image"])[:20].reshape(-1, 3), axis=0))  # noqa: E731 (the wall)
    assert all(colours(r) >= 2 for r in ood) and all(colours(r) == 1 for r in ind)


def test_rooms_are_deterministic_and_export_as_ovd_samples(tmp_path):
    a, b = make_scene("ood", 7, 3, 224, "isr"), make_scene("ood", 7, 3, 224, "isr")
    assert a["meta"] == b["meta"] and np.array_equal(np.asarray(a["image"]), np.asarray(b["image"]))
    assert make_scene("ood", 7, 4, 224, "isr")["meta"] != a["meta"]
    path = export_jsonl(tmp_path, "train", 6, seed=0, task="isr")
    assert path.name == "train_isr.jsonl"
    records = read_jsonl(path, task="ovd")
    assert len(records) == 6 and all(r.task == "ovd" and r.boxes for r in records)
    first = make_scene("train", 0, 0, 224, "isr")
    assert records[0].query == first["meta"]["query"] and records[0].boxes == first["solution"]
