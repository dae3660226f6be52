"""Exact per-object masks of a toy scene, from its ``meta`` alone (no image needed).

The toy world draws every object (target, other foreground objects, painted distractors) as
``grammar.shape_mask(shape, w, h)`` placed at its tight ``box``; occluders are flat rectangles drawn over everything.
So an object's mask is exact, not estimated:

- ``visible=True`` (the default, what referring segmentation scores: GRES / gRefCOCO masks are the visible pixels):
  the pixels that show the object, ``scene.owner_map(meta) == i`` (painted distractors under the foreground,
  occluders over everything, as ``scene.render_meta`` composes the image);
- ``visible=False`` (amodal): the object's whole shape, occluded or not.

A no-target scene's target mask is empty (all False): the region spaces read an empty mask as ``NO_TARGET``.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from core.toy import grammar
from core.toy.scene import owner_map

__all__ = ["mask_box", "object_mask", "object_masks", "target_mask"]


def _amodal(meta: dict[str, Any], obj: dict[str, Any]) -> np.ndarray:
    h, w = meta["height"], meta["width"]
    out = np.zeros((h, w), dtype=bool)
    x1, y1, x2, y2 = obj["box"]
    local = grammar.shape_mask(obj["shape"], x2 - x1, y2 - y1)
    cx1, cy1, cx2, cy2 = max(x1, 0), max(y1, 0), min(x2, w), min(y2, h)  # a box is inside the image; clip anyway
    if cx1 < cx2 and cy1 < cy2:
        out[cy1:cy2, cx1:cx2] = local[cy1 - y1 : cy2 - y1, cx1 - x1 : cx2 - x1]
    return out


def object_masks(meta: dict[str, Any], *, visible: bool = True) -> list[np.ndarray]:
    """bool ``[H, W]`` per object of ``meta["objects"]`` (same order): visible pixels, or the whole shape."""
    if not visible:
        return [_amodal(meta, o) for o in meta["objects"]]
    owner = owner_map(meta)
    return [owner == i for i in range(len(meta["objects"]))]


def object_mask(meta: dict[str, Any], index: int, *, visible: bool = True) -> np.ndarray:
    """bool ``[H, W]`` of object ``index`` of ``meta["objects"]``."""
    if visible:
        return owner_map(meta) == index
    return _amodal(meta, meta["objects"][index])


def target_mask(meta: dict[str, Any], *, visible: bool = True) -> np.ndarray:
    """The union of the scene's ``target`` objects (one for REC, one to three for OVD; none, so all False, for a
    no-target scene)."""
    masks = object_masks(meta, visible=visible)
    out = np.zeros((meta["height"], meta["width"]), dtype=bool)
    for o, m in zip(meta["objects"], masks):
        if o["role"] == "target":
            out |= m
    return out


def mask_box(mask: np.ndarray) -> tuple[int, int, int, int] | None:
    """The tight box ``(x1, y1, x2, y2)`` of a bool mask (pixels ``x1 <= x < x2``), None when it is empty."""
    mask = np.asarray(mask, dtype=bool)
    rows, cols = np.flatnonzero(mask.any(1)), np.flatnonzero(mask.any(0))
    if rows.size == 0:
        return None
    return int(cols[0]), int(rows[0]), int(cols[-1]) + 1, int(rows[-1]) + 1
