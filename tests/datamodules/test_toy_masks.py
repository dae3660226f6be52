"""core/toy/masks.py: the toy world's per-object masks are exact (the pixels of the rendered image)."""

from __future__ import annotations

import copy

import numpy as np

from core.toy.grammar import COLOURS
from core.toy.masks import mask_box, object_mask, object_masks, target_mask
from core.toy.scene import render_meta
from datamodules.toy import make_scene


def test_visible_masks_are_the_objects_pixels_and_their_boxes_are_tight():
    for split in ("train", "ood", "crowded"):
        for i in range(6):
            rec = make_scene(split, i, 0)
            meta, image = rec["meta"], np.asarray(rec["image"].convert("RGB"))
            masks = object_masks(meta)
            assert len(masks) == len(meta["objects"])
            for o, m in zip(meta["objects"], masks):
                assert m.dtype == bool and m.shape == (meta["height"], meta["width"])
                assert (image[m] == COLOURS[o["colour"]]).all()  # every mask pixel shows the object's colour
                assert mask_box(m) == tuple(o["box"])  # toy objects are apart: nothing hides part of one
            assert not np.logical_and(masks[0], np.any(masks[1:], axis=0)).any()  # visible masks never overlap


def test_occluded_object_visible_versus_amodal():
    rec = make_scene("train", 0, 0)
    meta = copy.deepcopy(rec["meta"])
    x1, y1, x2, y2 = meta["objects"][0]["box"]
    meta["occluders"] = [{"box": [x1, y1, (x1 + x2) // 2, y2], "colour": "gray"}]  # covers the left half
    visible, whole = object_mask(meta, 0), object_mask(meta, 0, visible=False)
    assert np.array_equal(whole, object_masks(rec["meta"])[0])  # the amodal mask ignores occluders
    assert visible.sum() < whole.sum() and not visible[:, : (x1 + x2) // 2].any()
    assert np.array_equal(visible, whole & ~_box(meta, (x1, y1, (x1 + x2) // 2, y2)))
    image = np.asarray(render_meta(meta)[0])
    assert (image[visible] == COLOURS[meta["objects"][0]["colour"]]).all()


def _box(meta, b):
    m = np.zeros((meta["height"], meta["width"]), dtype=bool)
    m[b[1] : b[3], b[0] : b[2]] = True
    return m


def test_target_mask_and_no_target():
    rec = make_scene("val", 1, 0)
    t = next(i for i, o in enumerate(rec["meta"]["objects"]) if o["role"] == "target")
    assert np.array_equal(target_mask(rec["meta"]), object_mask(rec["meta"], t))
    nt = next(r for r in (make_scene("val_nt", i, 0) for i in range(40)) if r["meta"].get("no_target"))
    assert not target_mask(nt["meta"]).any()
    ovd = make_scene("train", 2, 0, task="ovd")
    n_targets = sum(o["role"] == "target" for o in ovd["meta"]["objects"])
    assert target_mask(ovd["meta"]).sum() == sum(
        m.sum() for o, m in zip(ovd["meta"]["objects"], object_masks(ovd["meta"])) if o["role"] == "target"
    )
    assert n_targets >= 1
    assert mask_box(np.zeros((4, 4), bool)) is None
