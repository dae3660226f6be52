"""Executing visual edits of a toy scene (EvolvedGRPO's visual instruction evolution): a job ``{"kind", "params"}``
(as ``datamodules.edit_plans.plan_visual_edit`` writes it, or as a client sends it to the data server) applied to
the scene's meta and re-rendered (``core.toy.scene.render_meta``), so the labels stay exact. The target's pixels and
box never change (a ``zoom`` maps its box by ``zoom_box`` and nothing else).

Kinds: ``lookalikes``, ``clutter``, ``occlude`` (``VISUAL_KINDS``, the harder versions) and the sub-problems
``declutter``, ``isolate`` and ``zoom`` (``SUB_VISUAL_KINDS``, easiest last). The data server (``synth.worker``) runs
``execute_job`` for toy edit steps and audits the kept foreground (``core.toy.scene.foreground_mask``), zoomed with
``zoom_array``.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

from core.toy.scene import _foreground, difficulty, render_meta, target_index

NEUTRALS = ("gray", "black", "white")
"""Occluder colours: never an object colour, so an occluder is never a "shape" of the query language."""
VISUAL_KINDS = ("lookalikes", "clutter", "occlude")
"""Visual edit kinds; each takes the level as its intensity."""
SUB_VISUAL_KIND = "declutter"
"""The visual sub-problem: the same foreground on a plain background without painted distractors."""
ISOLATE_KIND = "isolate"
"""The easier visual sub-problem (``Level.sub == 2``): declutter, and remove every other object the query does not
need to stay exact (look-alikes first), so the target stands with its anchors only."""
ZOOM_KIND = "zoom"
"""The other easier visual sub-problem (``Level.sub == 2`` with ``easier="zoom"``): the image cropped to a window of
``1 / ZOOM_FACTOR`` of its sides around the target and re-rendered ``ZOOM_FACTOR`` times larger, so every object kept
(those wholly inside the window) is drawn larger at its mapped box. For the toy model's failures of small-object box
precision (experiments/evolved_grpo_results.md, "The zoom study"); the target's box changes, which the data
server's audit checks against the input mapped by the same zoom (``zoom_array``)."""
ZOOM_FACTOR = 2
"""How much larger a zoomed sub-problem draws the scene (an integer: boxes map to exact integer pixels)."""
SUB_VISUAL_KINDS = (SUB_VISUAL_KIND, ISOLATE_KIND, ZOOM_KIND)
"""The visual sub-problems, easiest last."""


def zoom_box(box: Sequence[float], factor: int, origin: Sequence[int]) -> list:
    """Where a box ``[x1, y1, x2, y2]`` (pixel edges) lands in a zoom by ``factor`` of the window at ``origin``."""
    ox, oy = origin
    return [(box[0] - ox) * factor, (box[1] - oy) * factor, (box[2] - ox) * factor, (box[3] - oy) * factor]


def zoom_array(arr: np.ndarray, factor: int, origin: Sequence[int]) -> np.ndarray:
    """An image (H x W [x C]) zoomed as ``ZOOM_KIND`` maps it: the window at ``origin`` of ``1 / factor`` of its sides,
    each pixel repeated ``factor`` x ``factor`` times (nearest neighbour: the data server's audit reference)."""
    h, w = arr.shape[:2]
    ox, oy = origin
    crop = arr[oy : oy + h // factor, ox : ox + w // factor]
    return np.repeat(np.repeat(crop, factor, axis=0), factor, axis=1)


def _zoom_window(meta: dict[str, Any], factor: int) -> tuple[int, int]:
    w, h = meta["width"], meta["height"]
    if not isinstance(factor, int) or factor < 2:
        raise ValueError(f"a zoom's factor is an integer >= 2, got {factor!r}")
    if w % factor or h % factor:
        raise ValueError(f"a zoom by {factor} needs image sides divisible by it; the scene is {w}x{h}")
    return w // factor, h // factor


def _inside(box: Sequence[float], outer: Sequence[float]) -> bool:
    return box[0] >= outer[0] and box[1] >= outer[1] and box[2] <= outer[2] and box[3] <= outer[3]


def execute_job(meta: dict[str, Any], job: dict[str, Any]) -> tuple[Image.Image, dict[str, Any]]:
    """Run a visual edit job on a toy scene: the new image and meta (objects, description, seeds, occluders and the
    job appended to ``meta["edits"]``). The target object is copied unchanged (a ``zoom`` maps its box by
    ``zoom_box`` and nothing else); raises if a job would touch it."""
    kind, params = job["kind"], job["params"]
    new = copy.deepcopy(meta)
    t = target_index(meta)
    target = meta["objects"][t]
    if kind == ZOOM_KIND:
        factor, (ox, oy) = params["factor"], [int(v) for v in params["origin"]]
        cw, ch = _zoom_window(meta, factor)
        if not (0 <= ox <= meta["width"] - cw and 0 <= oy <= meta["height"] - ch):
            raise ValueError(
                f"zoom window at {[ox, oy]} of {cw}x{ch} leaves the {meta['width']}x{meta['height']} image"
            )
        window = (ox, oy, ox + cw, oy + ch)
        if not _inside(target["box"], window):
            raise ValueError(f"zoom window at {[ox, oy]} of {cw}x{ch} cuts the target's box {target['box']}")
        kept = [o for o in _foreground(meta) if _inside(o["box"], window)]
        new["objects"] = [dict(o, box=zoom_box(o["box"], factor, (ox, oy))) for o in kept]
        new["occluders"] = [  # those on a kept object; an occluder of a painted distractor has nothing left to cover
            dict(occ, box=zoom_box(occ["box"], factor, (ox, oy)))
            for occ in meta.get("occluders", [])
            if any(_inside(occ["box"], o["box"]) for o in kept)
        ]
        new["n_painted"] = int(params["n_painted"])
        target = dict(target, box=zoom_box(target["box"], factor, (ox, oy)))
    elif kind == "lookalikes":
        new["objects"] = _foreground(meta) + [{"role": "object", **o} for o in params["objects"]]
        new["n_painted"] = sum(o["role"] == "distractor" for o in meta["objects"])
        new["render_seed"] = params["render_seed"]
    elif kind in ("clutter", SUB_VISUAL_KIND, ISOLATE_KIND):
        new["objects"] = _foreground(meta)
        if kind == ISOLATE_KIND:
            keep = [list(b) for b in params["keep"]]
            new["objects"] = [o for o in new["objects"] if o["role"] == "target" or list(o["box"]) in keep]
        new["occluders"] = []  # they covered painted distractors that are gone
        new["description"] = params["description"]
        new["n_painted"] = params["n_painted"]
        new["render_seed"] = params.get("render_seed", meta["render_seed"])
    elif kind == "occlude":
        tb = target["box"]
        for occ in params["occluders"]:
            b = occ["box"]
            if b[0] < tb[2] + 1 and b[2] > tb[0] - 1 and b[1] < tb[3] + 1 and b[3] > tb[1] - 1:
                raise ValueError(f"occluder {b} would come within 1 px of the target's box {tb}")
            if occ["colour"] not in NEUTRALS:
                raise ValueError(f"occluders are neutral ({NEUTRALS}), got {occ['colour']!r}")
        new["occluders"] = list(meta.get("occluders", [])) + list(params["occluders"])
    else:
        raise ValueError(f"unknown visual job kind {kind!r}")
    image, objects = render_meta(new)
    new["objects"] = objects
    new["n_painted"] = sum(o["role"] == "distractor" for o in objects)
    new["edits"] = list(meta.get("edits", [])) + [job]
    new["difficulty"] = round(difficulty(new), 4)
    if new["objects"][target_index(new)] != target:
        raise AssertionError("a visual edit changed the target object")  # render_meta copies the foreground
    return image, new
