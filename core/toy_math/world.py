"""The toy visual-math world: scenes whose content is countable or measurable, problems about them and their exact
answers, all seeded and deterministic (the same key gives the same bytes).

Two scene kinds, both plain JSON (``scene``) rendered by :func:`render`:

- ``shapes``: 3-14 coloured shapes (``core.toy.grammar``'s colours and shapes, 16-28 px, never touching) on white;
- ``bars``: a bar chart of 3-6 bars of distinct colours with integer values, horizontal grid lines 1 unit apart and
  no text (the value is read by counting grid lines).

Problem kinds (:data:`KINDS`; a problem is a structured ``query``, its text and its answer, ``evaluate(scene, query)``):

======================  ===========================================================================  ==============
kind                    question                                                                     answer
======================  ===========================================================================  ==============
``count``               How many red shapes / circles / red circles / shapes in total ...?           an integer
``count_diff``          How many more red shapes than blue shapes ...?                               an integer
``most_choice``         Which colour do the most shapes have? A. ... B. ... C. ... D. ...            a letter
``bar_value``           What is the value of the green bar?                                          an integer
``bar_total``           What is the sum of the values of all the bars?                               an integer
``bar_range``           How much greater is the tallest bar's value than the shortest bar's?         an integer
======================  ===========================================================================  ==============
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from core.toy import grammar
from core.toy.grammar import COLOURS, OBJECT_COLOURS, SHAPES
from core.toy.scene import first_free_square

__all__ = ["KINDS", "LETTERS", "evaluate", "make_query", "make_scene", "question", "render"]

KINDS = ("count", "count_diff", "most_choice", "bar_value", "bar_total", "bar_range")
"""Problem kinds, in the order a split cycles through them (``index % len(KINDS)``)."""
SCENE_OF = {"count": "shapes", "count_diff": "shapes", "most_choice": "shapes"} | {
    k: "bars" for k in ("bar_value", "bar_total", "bar_range")
}
LETTERS = "ABCD"
GRID_NOTE = "The grid lines of the chart are 1 unit apart."


def _pick(rng: np.random.Generator, values, k: int | None = None):
    if k is None:
        return values[int(rng.integers(len(values)))]
    return [values[i] for i in sorted(rng.choice(len(values), size=k, replace=False).tolist())]


# --- scenes ----------------------------------------------------------------------------------------------------------


def make_scene(
    rng: np.random.Generator, kind: str, size: int, objects: tuple[int, int], bars: tuple[int, int], max_value: int
) -> dict[str, Any]:
    """A ``shapes`` scene with ``objects`` (inclusive range) shapes, or a ``bars`` scene with ``bars`` bars valued
    1..``max_value`` (not all equal)."""
    if kind == "shapes":
        colours = _pick(rng, OBJECT_COLOURS, int(rng.integers(2, 5)))
        shapes = _pick(rng, SHAPES, 3)
        n = int(rng.integers(objects[0], objects[1] + 1))
        placed: list[dict[str, Any]] = []
        boxes: list[tuple[int, int, int, int]] = []
        for _ in range(n):
            side = int(rng.integers(round(size * 0.07), round(size * 0.125) + 1))
            box = first_free_square(rng, side, boxes, (4, size - side - 4, 4, size - side - 4), gap=4, tries=256)
            if box is None:  # the canvas is full: the scene holds what fitted (its objects are the truth)
                break
            boxes.append(box)
            placed.append({"shape": _pick(rng, shapes), "colour": _pick(rng, colours), "box": list(box)})
        return {"kind": "shapes", "size": size, "objects": placed}
    if kind == "bars":
        k = int(rng.integers(bars[0], bars[1] + 1))
        colours = _pick(rng, OBJECT_COLOURS, k)
        rng.shuffle(colours)
        while True:
            values = [int(v) for v in rng.integers(1, max_value + 1, size=k)]
            if len(set(values)) > 1:
                break
        return {
            "kind": "bars",
            "size": size,
            "max_value": max_value,
            "bars": [{"colour": c, "value": v} for c, v in zip(colours, values)],
        }
    raise ValueError(f"unknown scene kind {kind!r}; choose shapes or bars")


def _chart_geometry(scene: dict[str, Any]) -> tuple[int, int, int, int, float]:
    """(left, top, right, bottom, pixels per unit) of the plot area."""
    s = scene["size"]
    left, right, top, bottom = round(0.1 * s), round(0.95 * s), round(0.06 * s), round(0.92 * s)
    return left, top, right, bottom, (bottom - top) / scene["max_value"]


def render(scene: dict[str, Any]) -> Image.Image:
    """The scene's image (RGB, ``size x size``), a pure function of the scene."""
    s = scene["size"]
    if scene["kind"] == "shapes":
        canvas = np.full((s, s, 3), 255, dtype=np.uint8)
        for o in scene["objects"]:
            grammar.draw_shape(canvas, o["shape"], o["colour"], o["box"])
        return Image.fromarray(canvas)
    image = Image.new("RGB", (s, s), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    left, top, right, bottom, unit = _chart_geometry(scene)
    for v in range(1, scene["max_value"] + 1):
        y = round(bottom - v * unit)
        draw.line([(left, y), (right, y)], fill=(200, 200, 200), width=1)
    slot = (right - left) / len(scene["bars"])
    for i, bar in enumerate(scene["bars"]):
        x1, x2 = round(left + (i + 0.2) * slot), round(left + (i + 0.8) * slot)
        draw.rectangle([x1, round(bottom - bar["value"] * unit), x2, bottom], fill=COLOURS[bar["colour"]])
    draw.line([(left, top), (left, bottom), (right, bottom)], fill=(0, 0, 0), width=2)
    return image


# --- problems --------------------------------------------------------------------------------------------------------


def _colour_counts(scene: dict[str, Any]) -> Counter:
    return Counter(o["colour"] for o in scene["objects"])


def make_query(rng: np.random.Generator, kind: str, scene: dict[str, Any]) -> dict[str, Any]:
    """A query of ``kind`` whose answer is well defined on ``scene``; a shapes kind the scene does not admit (all
    colours equally frequent for ``count_diff``, no unique most frequent colour for ``most_choice``) falls back to
    ``count``."""
    if SCENE_OF[kind] != scene["kind"]:
        raise ValueError(f"a {kind} problem needs a {SCENE_OF[kind]} scene, got {scene['kind']}")
    if scene["kind"] == "bars":
        if kind == "bar_value":
            return {"op": "bar_value", "colour": _pick(rng, [b["colour"] for b in scene["bars"]])}
        return {"op": kind}
    counts = _colour_counts(scene)
    if kind == "count_diff":
        pairs = [(a, b) for a in counts for b in counts if counts[a] > counts[b]]
        if pairs:
            a, b = _pick(rng, pairs)
            return {"op": "count_diff", "a": a, "b": b}
    if kind == "most_choice":
        ranked = counts.most_common()
        if len(ranked) == 1 or ranked[0][1] > ranked[1][1]:
            present = [c for c, _ in ranked][:4]
            absent = [c for c in OBJECT_COLOURS if c not in present]
            options = present + _pick(rng, absent, 4 - len(present))
            rng.shuffle(options)
            return {"op": "most_choice", "options": options}
    o = _pick(rng, scene["objects"])
    form = _pick(rng, ("colour", "colour", "shape", "both", "total"))
    return {
        "op": "count",
        "colour": o["colour"] if form in ("colour", "both") else None,
        "shape": o["shape"] if form in ("shape", "both") else None,
    }


def evaluate(scene: dict[str, Any], query: dict[str, Any]) -> int | str:
    """The exact answer of ``query`` on ``scene``: an integer, or a choice letter."""
    op = query["op"]
    if op == "count":
        return sum(
            (query["colour"] in (None, o["colour"])) and (query["shape"] in (None, o["shape"]))
            for o in scene["objects"]
        )
    if op == "count_diff":
        counts = _colour_counts(scene)
        return counts[query["a"]] - counts[query["b"]]
    if op == "most_choice":
        counts = _colour_counts(scene)
        best = max(query["options"], key=lambda c: counts[c])
        return LETTERS[query["options"].index(best)]
    values = {b["colour"]: b["value"] for b in scene["bars"]}
    if op == "bar_value":
        return values[query["colour"]]
    if op == "bar_total":
        return sum(values.values())
    if op == "bar_range":
        return max(values.values()) - min(values.values())
    raise ValueError(f"unknown query op {op!r}")


def question(query: dict[str, Any]) -> str:
    """The problem text of ``query``."""
    op = query["op"]
    if op == "count":
        colour, shape = query["colour"], query["shape"]
        if colour is None and shape is None:
            return "How many shapes are there in the image in total?"
        noun = grammar.plural(shape) if shape else "shapes"
        return f"How many {colour + ' ' if colour else ''}{noun} are there in the image?"
    if op == "count_diff":
        return f"How many more {query['a']} shapes than {query['b']} shapes are there in the image?"
    if op == "most_choice":
        options = "\n".join(f"{LETTERS[i]}. {c}" for i, c in enumerate(query["options"]))
        return f"Which colour do the most shapes in the image have?\n{options}"
    if op == "bar_value":
        return f"{GRID_NOTE} What is the value of the {query['colour']} bar?"
    if op == "bar_total":
        return f"{GRID_NOTE} What is the sum of the values of all the bars?"
    if op == "bar_range":
        return f"{GRID_NOTE} How much greater is the tallest bar's value than the shortest bar's value?"
    raise ValueError(f"unknown query op {op!r}")
