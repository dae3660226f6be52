"""The toy ISR world: indoor-like rooms with several labelled pieces of furniture (issue 41's toy analogue of ISR).

The paper's ISR perception stage is OVD on rendered 3D-FRONT views: "box every object of this category" in a furnished
room (docs/isr.md). Its toy analogue draws a room (a wall above a floor, split at a horizon) and 3-9 pieces of
furniture of 2-4 categories standing on the floor, each drawn procedurally inside its box from a few filled parts, in
one of the toy world's object colours. The query names a category ("chair"); the solution is every box of that
category, as in ``datamodules.isr``'s per-category lines, and the reward is OVD's (``s_ovd * mAP``).

Every box is the tight extent of the pixels drawn for its object (objects never overlap), so a label is exact. Splits
(``ood``: the distribution shift of the REC toy's ``ood``): in-domain rooms are plain, with 3-6 objects; out-of-domain
rooms have striped wallpaper and a tiled floor, 6-9 objects, and more categories per room.

Pure functions: ``draw_furniture`` draws one object onto an array, ``indoor_scene`` draws a whole room from a
generator and returns the image with its objects.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from core.toy.grammar import COLOURS, OBJECT_COLOURS

__all__ = ["CATEGORIES", "draw_furniture", "indoor_scene"]

CATEGORIES: dict[str, tuple[float, tuple[float, float]]] = {
    "bed": (1.8, (0.16, 0.22)),
    "sofa": (1.6, (0.15, 0.21)),
    "table": (1.4, (0.13, 0.18)),
    "chair": (0.7, (0.15, 0.21)),
    "lamp": (0.45, (0.22, 0.30)),
    "shelf": (0.6, (0.26, 0.34)),
    "plant": (0.65, (0.15, 0.21)),
}
"""Category -> (box width / height, box height as a fraction of the image side: low, high)."""

WALLS = ("white", "gray", "yellow", "cyan", "pink")
FLOORS = ("gray", "black", "orange", "purple", "brown")


def _rgb(name: str) -> tuple[int, int, int]:
    return COLOURS[name] if name in COLOURS else {"brown": (120, 80, 40)}[name]


def _parts(category: str, w: float, h: float) -> list[tuple[str, list[float]]]:
    """The filled parts of a category in a ``w x h`` box, as (kind, coordinates relative to the box's top-left).
    Together they touch all four box edges, so the box is the drawing's tight extent."""
    if category == "bed":
        return [
            ("rect", [0, 0, 0.12 * w, h]),
            ("rect", [0, 0.45 * h, w, h]),
            ("light", [0.15 * w, 0.3 * h, 0.4 * w, 0.45 * h]),
        ]
    if category == "sofa":
        return [("rect", [0.12 * w, 0, 0.88 * w, 0.55 * h]), ("rect", [0, 0.35 * h, 0.14 * w, h]),
                ("rect", [0.86 * w, 0.35 * h, w, h]), ("light", [0.14 * w, 0.55 * h, 0.86 * w, 0.8 * h]),
                ("rect", [0.14 * w, 0.8 * h, 0.86 * w, h])]  # fmt: skip
    if category == "table":
        return [("rect", [0, 0, w, 0.18 * h]), ("rect", [0.05 * w, 0, 0.15 * w, h]), ("rect", [0.85 * w, 0, 0.95 * w, h]),
                ("rect", [0, 0, 0.05 * w, 0.18 * h]), ("rect", [0.95 * w, 0, w, 0.18 * h])]  # fmt: skip
    if category == "chair":
        return [("rect", [0, 0, 0.22 * w, 0.62 * h]), ("rect", [0, 0.5 * h, w, 0.62 * h]), ("rect", [0, 0.62 * h, 0.12 * w, h]),
                ("rect", [0.88 * w, 0.62 * h, w, h])]  # fmt: skip
    if category == "lamp":
        return [("poly", [0.2 * w, 0, 0.8 * w, 0, w, 0.4 * h, 0, 0.4 * h]), ("rect", [0.42 * w, 0.4 * h, 0.58 * w, 0.9 * h]),
                ("rect", [0.15 * w, 0.9 * h, 0.85 * w, h])]  # fmt: skip
    if category == "shelf":
        parts = [("rect", [0, 0, w, 0.06 * h]), ("rect", [0, 0, 0.1 * w, h]), ("rect", [0.9 * w, 0, w, h])]
        return parts + [("rect", [0, f * h, w, f * h + 0.06 * h]) for f in (0.31, 0.62, 0.94)]
    if category == "plant":
        return [
            ("ellipse", [0, 0, w, 0.68 * h]),
            ("poly", [0.2 * w, 0.6 * h, 0.8 * w, 0.6 * h, 0.7 * w, h, 0.3 * w, h]),
        ]
    raise ValueError(f"unknown furniture category {category!r}; one of {sorted(CATEGORIES)}")


def draw_furniture(
    canvas: np.ndarray, category: str, colour: str, box: list[int] | tuple[int, ...], mask: np.ndarray | None = None
) -> list[int] | None:
    """Draw ``category`` in ``colour`` (an object colour of the toy grammar) inside ``box`` (``[x1, y1, x2, y2]``,
    integer pixels, ``x1 <= x < x2``) of the ``[H, W, 3]`` uint8 ``canvas``, in place. Its lighter parts (a pillow, a
    cushion) are the colour mixed with white. ``mask`` (bool ``[H, W]``) gets the drawn pixels OR-ed in. Returns the
    tight box of the drawn pixels (None when nothing landed on the canvas)."""
    x1, y1, x2, y2 = (int(v) for v in box)
    w, h = x2 - x1, y2 - y1
    if w < 4 or h < 4:
        raise ValueError(f"a {category} needs a box of at least 4 x 4 pixels, got {box}")
    layer = Image.new("L", (w, h), 0)
    shade = Image.new("L", (w, h), 0)
    for kind, xy in _parts(category, float(w), float(h)):
        target = shade if kind == "light" else layer
        draw = ImageDraw.Draw(target)
        if kind in ("rect", "light"):
            draw.rectangle([xy[0], xy[1], max(xy[0], xy[2] - 1), max(xy[1], xy[3] - 1)], fill=255)
        elif kind == "ellipse":
            draw.ellipse([xy[0], xy[1], xy[2] - 1, xy[3] - 1], fill=255)
        else:
            draw.polygon([(min(x, w - 1), min(y, h - 1)) for x, y in zip(xy[::2], xy[1::2])], fill=255)
    body = np.asarray(layer) > 0
    light = (np.asarray(shade) > 0) & ~body
    H, W = canvas.shape[:2]
    cx1, cy1, cx2, cy2 = max(0, x1), max(0, y1), min(W, x2), min(H, y2)
    if cx1 >= cx2 or cy1 >= cy2:
        return None
    sub = (slice(cy1 - y1, cy2 - y1), slice(cx1 - x1, cx2 - x1))
    body, light = body[sub], light[sub]
    rgb = np.array(_rgb(colour), dtype=np.float32)
    region = canvas[cy1:cy2, cx1:cx2]
    region[body] = rgb.astype(np.uint8)
    region[light] = ((rgb + 255.0) / 2).astype(np.uint8)
    drawn = body | light
    if mask is not None:
        mask[cy1:cy2, cx1:cx2] |= drawn
    if not drawn.any():
        return None
    rows, cols = np.nonzero(drawn)
    return [int(cx1 + cols.min()), int(cy1 + rows.min()), int(cx1 + cols.max() + 1), int(cy1 + rows.max() + 1)]


def _room(size: int, wall: str, floor: str, horizon: int, textured: bool) -> np.ndarray:
    canvas = np.zeros((size, size, 3), dtype=np.uint8)
    canvas[:horizon] = _rgb(wall)
    canvas[horizon:] = _rgb(floor)
    if textured:  # striped wallpaper and a tiled floor
        stripe = max(4, size // 28)
        for x in range(0, size, 2 * stripe):
            canvas[:horizon, x : x + stripe] = ((np.array(_rgb(wall), dtype=np.int32) * 3 + 255) // 4).astype(np.uint8)
        tile = max(8, size // 10)
        ys, xs = np.mgrid[horizon:size, 0:size]
        dark = ((ys - horizon) // tile + xs // tile) % 2 == 1
        canvas[horizon:][dark] = (np.array(_rgb(floor), dtype=np.int32) * 3 // 4).astype(np.uint8)
    else:  # a skirting line where the wall meets the floor
        canvas[max(0, horizon - 2) : horizon] = (np.array(_rgb(wall), dtype=np.int32) * 2 // 3).astype(np.uint8)
    return canvas


def indoor_scene(rng: np.random.Generator, size: int = 224, ood: bool = False) -> dict[str, Any]:
    """One room: ``{"image": PIL, "objects": [{"category", "colour", "box"}...], "query": category, "solution":
    sorted boxes of that category, "wall", "floor", "horizon"}``. Objects stand on the floor and never overlap; a
    piece that finds no room is dropped (the queried category always keeps at least one)."""
    n_objects = int(rng.integers(6, 10)) if ood else int(rng.integers(3, 7))
    n_categories = int(rng.integers(3, 5)) if ood else int(rng.integers(2, 4))
    names = list(CATEGORIES)
    cats = [names[i] for i in rng.choice(len(names), size=n_categories, replace=False)]
    wall = WALLS[int(rng.integers(len(WALLS)))]
    floor = FLOORS[int(rng.integers(len(FLOORS)))]
    horizon = int(size * rng.uniform(0.35, 0.5))
    canvas = _room(size, wall, floor, horizon, textured=ood)
    colours = [c for c in OBJECT_COLOURS if c not in (wall, floor)]  # every object stands out from the room
    placed: list[list[int]] = []
    objects: list[dict[str, Any]] = []
    order = [cats[0]] + [cats[int(rng.integers(n_categories))] for _ in range(n_objects - 1)]
    for category in order:
        aspect, (lo, hi) = CATEGORIES[category]
        h = max(8, int(size * rng.uniform(lo, hi)))
        w = max(6, min(size - 2, int(h * aspect)))
        colour = colours[int(rng.integers(len(colours)))]
        for _ in range(64):
            x1 = int(rng.integers(1, max(2, size - w - 1)))
            bottom = int(rng.integers(min(size - 1, horizon + h // 3 + 4), size))
            box = [x1, bottom - h, x1 + w, bottom]
            if box[1] < 1 or any(_overlap(box, p, 2) for p in placed):
                continue
            drawn = draw_furniture(canvas, category, colour, box)
            placed.append(box)
            objects.append({"category": category, "colour": colour, "box": drawn})
            break
    query = objects[0]["category"]
    solution = sorted((o["box"] for o in objects if o["category"] == query), key=lambda b: (b[1], b[0]))
    return {
        "image": Image.fromarray(canvas),
        "objects": objects,
        "query": query,
        "solution": solution,
        "wall": wall,
        "floor": floor,
        "horizon": horizon,
    }


def _overlap(a: list[int], b: list[int], margin: int) -> bool:
    return not (a[2] + margin <= b[0] or b[2] + margin <= a[0] or a[3] + margin <= b[1] or b[3] + margin <= a[1])
