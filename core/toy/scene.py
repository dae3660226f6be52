"""The toy world's scene model: a scene's ``meta`` (its objects with their roles, sizes, colours, shapes and boxes,
the description rendered around them, the render seed and occluders), what each pixel shows, how hard the scene
is, and its re-rendering from the meta alone.

``meta["objects"]`` holds the target(s), the other foreground objects and the painted distractors; occluders are not
objects. ``render_meta`` draws the foreground with ``grammar.draw_shape``, the description around it
(``grammar.render_with_layout``, same seed and avoid mask as the toy world's scene drawing) and the occluders on top:
on an unedited toy scene it reproduces the image bit for bit, so a visual edit (``core.toy.edits``) is a change of
the meta and a re-render.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, Literal

import numpy as np
from PIL import Image

from core.toy import grammar
from core.toy.grammar import COLOURS, OBJECT_COLOURS


def _objects(meta: dict[str, Any]) -> list[dict[str, Any]]:
    return meta["objects"]


def target_index(meta: dict[str, Any]) -> int:
    """Index of the one REC target in ``meta["objects"]``; raises for OVD scenes (several targets)."""
    idx = [i for i, o in enumerate(_objects(meta)) if o["role"] == "target"]
    if len(idx) != 1:
        raise ValueError(
            f"evolve edits REC scenes with one target; this scene has {len(idx)} (task {meta.get('task')})"
        )
    return idx[0]


def _foreground(meta: dict[str, Any]) -> list[dict[str, Any]]:
    return [o for o in _objects(meta) if o["role"] != "distractor"]


# --- visibility ------------------------------------------------------------------------------------------------------


Visibility = Literal["clear", "occluded", "hidden"]


def owner_map(meta: dict[str, Any]) -> np.ndarray:
    """int32 ``[H, W]``: which object's pixel each pixel shows (index into ``meta["objects"]``), -1 for the background,
    -2 for an occluder. Painted distractors are drawn in list order under the foreground, occluders over everything,
    exactly as ``render_meta`` composes the image."""
    h, w = meta["height"], meta["width"]
    owner = np.full((h, w), -1, dtype=np.int32)
    objects = _objects(meta)
    order = [i for i, o in enumerate(objects) if o["role"] == "distractor"]
    order += [i for i, o in enumerate(objects) if o["role"] != "distractor"]
    for i in order:
        x1, y1, x2, y2 = objects[i]["box"]
        owner[y1:y2, x1:x2][grammar.shape_mask(objects[i]["shape"], x2 - x1, y2 - y1)] = i
    for occ in meta.get("occluders", []):
        x1, y1, x2, y2 = occ["box"]
        owner[y1:y2, x1:x2] = -2
    return owner


def foreground_mask(meta: dict[str, Any], boxes: Sequence[Sequence[float]]) -> np.ndarray:
    """bool ``[H, W]``: the shape pixels of the scene's objects whose boxes are ``boxes`` (the pixels a visual edit
    must leave as they are: the data server audits them); raises when a box is no object of the scene."""
    h, w = meta["height"], meta["width"]
    out = np.zeros((h, w), dtype=bool)
    for b in boxes:
        o = next((o for o in _objects(meta) if list(o["box"]) == [int(round(v)) for v in b]), None)
        if o is None:
            raise ValueError(f"the box {list(b)} is no object of the scene: send the scene that goes with the image")
        x1, y1, x2, y2 = o["box"]
        out[y1:y2, x1:x2] |= grammar.shape_mask(o["shape"], x2 - x1, y2 - y1)
    return out


def visibility(meta: dict[str, Any], owner: np.ndarray | None = None) -> list[Visibility]:
    """Per object: ``clear`` (every pixel of its shape shows and no other object's box comes within 1 px of its box),
    ``occluded`` (apart from other objects, partly under an occluder, but every row and column of its shape still
    shows a pixel, so its extent, hence size and position, and its colour stay visible) or ``hidden``."""
    owner = owner_map(meta) if owner is None else owner
    objects = _objects(meta)
    boxes = np.array([o["box"] for o in objects], dtype=np.int64).reshape(-1, 4)
    out: list[Visibility] = []
    for i, o in enumerate(objects):
        x1, y1, x2, y2 = o["box"]
        g = boxes[i] + np.array([-1, -1, 1, 1])
        touch = (boxes[:, 0] < g[2]) & (boxes[:, 2] > g[0]) & (boxes[:, 1] < g[3]) & (boxes[:, 3] > g[1])
        touch[i] = False
        mask = grammar.shape_mask(o["shape"], x2 - x1, y2 - y1)
        shown = (owner[y1:y2, x1:x2] == i) & mask
        if touch.any():
            out.append("hidden")
        elif shown.sum() == mask.sum():
            out.append("clear")
        elif shown.any(0).all() and shown.any(1).all():
            out.append("occluded")
        else:
            out.append("hidden")
    return out


# --- difficulty ------------------------------------------------------------------------------------------------------


def difficulty(scene: dict[str, Any]) -> float:
    """A [0, 1] estimate of how hard a scene is (a record with ``meta`` or the ``meta`` itself).

    A weighted sum of: how many other objects there are (8 or more = 1), how many attributes they share with the
    (nearest) target on average (out of 2), whether a target is small, whether the background is textured, and how
    close the nearest other object is. Weights 0.3 / 0.25 / 0.15 / 0.15 / 0.15. It is the toy model's SFT target
    for ``<diversity>``: hard scenes are the ones where a model's answers should scatter.
    """
    meta = scene.get("meta", scene)
    objects = meta["objects"]
    targets = [o for o in objects if o["role"] == "target"]
    others = [o for o in objects if o["role"] != "target"]
    if not targets:
        return 0.0
    extent = float(max(meta.get("width", 224), meta.get("height", 224)))

    def centre(o: dict) -> np.ndarray:
        x1, y1, x2, y2 = o["box"]
        return np.array([(x1 + x2) / 2, (y1 + y2) / 2])

    shared, nearest = [], extent
    for o in others:
        shared.append(max(sum(o[a] == t[a] for a in ("size", "colour", "shape")) for t in targets))
        nearest = min(nearest, min(float(np.linalg.norm(centre(o) - centre(t))) for t in targets))
    f_count = min(len(others) / 8, 1.0)
    f_share = float(np.mean(shared)) / 2 if shared else 0.0
    f_small = float(any(t["size"] == "small" for t in targets))
    described = grammar.parse_description(meta.get("description", ""))
    f_texture = float(described is not None and described.background in grammar.TEXTURED_BACKGROUNDS)
    f_near = 1.0 - min(nearest / (0.5 * extent), 1.0) if others else 0.0
    score = 0.3 * f_count + 0.25 * min(f_share, 1.0) + 0.15 * f_small + 0.15 * f_texture + 0.15 * f_near
    return float(np.clip(score, 0.0, 1.0))


# --- layout and rendering ---------------------------------------------------------------------------------------------


def first_free_square(
    rng: np.random.Generator, side: int, boxes, bounds: tuple[int, int, int, int], gap: int, tries: int
) -> tuple[int, int, int, int] | None:
    """The first of ``tries`` random ``side x side`` squares with top-left in ``bounds`` (x_lo, x_hi, y_lo, y_hi,
    inclusive) that keeps ``gap`` pixels clear of every box in ``boxes``; None when none does."""
    xlo, xhi, ylo, yhi = bounds
    xs = rng.integers(xlo, xhi + 1, size=tries)
    ys = rng.integers(ylo, yhi + 1, size=tries)
    free = np.ones(tries, dtype=bool)
    for bx1, by1, bx2, by2 in boxes:
        free &= (xs >= bx2 + gap) | (xs + side <= bx1 - gap) | (ys >= by2 + gap) | (ys + side <= by1 - gap)
    hits = np.flatnonzero(free)
    if hits.size == 0:
        return None
    j = int(hits[0])
    return (int(xs[j]), int(ys[j]), int(xs[j]) + side, int(ys[j]) + side)


def render_meta(meta: dict[str, Any]) -> tuple[Image.Image, list[dict[str, Any]]]:
    """Re-render a scene from its ``meta`` with the toy world's renderer: the foreground objects drawn with
    ``grammar.draw_shape``, the description rendered around them (same seed, same number of painted distractors,
    same avoid mask as ``toy.make_scene``), then the occluders. Returns the image and the objects (foreground + the
    painted distractors where the layout put them). On an unedited toy scene it reproduces the image bit for bit."""
    w, h = meta["width"], meta["height"]
    fore = _foreground(meta)
    canvas = np.zeros((h, w, 3), dtype=np.uint8)
    keep = np.zeros((h, w), dtype=bool)
    avoid = np.zeros((h, w), dtype=bool)
    for o in fore:
        drawn = grammar.draw_shape(canvas, o["shape"], o["colour"], o["box"], mask=keep)
        if drawn != tuple(o["box"]):
            raise ValueError(f"foreground object {o} does not fill its box inside the {w}x{h} image")
    for x1, y1, x2, y2 in (o["box"] for o in fore):
        avoid[max(0, y1 - 3) : y2 + 3, max(0, x1 - 3) : x2 + 3] = True
    n_painted = meta.get("n_painted", sum(o["role"] == "distractor" for o in _objects(meta)))
    image, placed = grammar.render_with_layout(
        Image.fromarray(canvas), keep, meta["description"], meta["render_seed"], n_distractors=n_painted,
        avoid_mask=avoid,
    )  # fmt: skip
    objects = [dict(o) for o in fore] + [
        {"role": "distractor", "size": p.size, "colour": p.colour, "shape": p.shape, "box": list(p.box)} for p in placed
    ]
    occluders = meta.get("occluders", [])
    if occluders:
        arr = np.array(image)
        for occ in occluders:
            x1, y1, x2, y2 = occ["box"]
            arr[y1:y2, x1:x2] = COLOURS[occ["colour"]]
        image = Image.fromarray(arr)
    return image, objects


# --- guarding model descriptions -------------------------------------------------------------------------------------


def guard_description(description: str, meta: dict[str, Any]) -> str:
    """Rewrite a description whose repaint would break the scene's label; otherwise return it unchanged.

    The painter draws what the policy asks for. Distractors identical to the referred object (same size, colour and
    shape) would make a REC query ambiguous; distractors of the queried colour would be unlabelled OVD objects; a
    plain background of the target's colour would hide it. Each clash swaps in the first object colour that clashes
    with nothing. Text the grammar does not read is returned as it is.
    """
    d = grammar.parse_description(description)
    targets = [o for o in meta.get("objects", []) if o.get("role") == "target"]
    if d is None or not targets:
        return description
    target_colours = {t["colour"] for t in targets}
    task = meta.get("task", "rec")
    changes: dict[str, Any] = {}
    if d.count != "no":
        same = any((d.shape, d.shape_colour, d.size) == (t["shape"], t["colour"], t["size"]) for t in targets)
        if same or (task == "ovd" and d.shape_colour in target_colours):
            changes["shape_colour"] = next(c for c in OBJECT_COLOURS if c not in target_colours | {d.colour})
    if d.background == "plain" and d.colour in target_colours:
        changes["colour"] = next(c for c in ("white", "gray", "black") if c not in target_colours)
    if not changes:
        return description
    return grammar.format_description(dataclasses.replace(d, **changes))
