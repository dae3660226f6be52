"""Instruction edits of toy visual-math scenes: EvolvedGRPO's image edits, made exact.

In EvolvedGRPO the question generator answers an image-edit row with ``{"edit_instruction": "..."}``, an image-edit
model (Qwen-Image-Edit) applies it, and the row's problem and answer are kept, so the instruction must leave the
answer alone (the seed asks for "only non-semantic visual appearance" changes and cannot check it). Here a small
grammar of instructions is parsed from free text, executed on the scene (``core.toy_math.world``'s JSON), and the
problem's answer is re-derived on the edited scene: an instruction outside the grammar, or one whose edit would change
the answer (or change nothing), raises :class:`InstructionError`, and the caller keeps the previous row.

The grammar (case-insensitive; clauses may be chained with ``;``, ``.`` or ``then``, at most :data:`MAX_CLAUSES`):

===============  ===================================================================  =======================
edit             examples                                                             scenes
===============  ===================================================================  =======================
background       change the background to light blue / make the background cream    both
noise            add noise / add some speckles / add heavy grid noise                 both (background only)
recolour         make the red circles blue / change the colour of the star to green  shapes; bars (one bar)
enlarge, shrink  make the squares bigger / enlarge the blue shapes by 20% / increase  shapes
                 the size of the stars / shrink the circles slightly
move             move the red circle left / shift the stars down by 10 pixels         shapes
bar width        thicken the bars / make the bars narrower                            bars
grid             darken the grid lines / make the grid darker                         bars
===============  ===================================================================  =======================

A selector is ``[all] [the] [<colour>] <noun>`` with a noun among the shapes (singular or plural), ``shape(s)``,
``object(s)`` or ``bar(s)``; a singular selector must match exactly one object. Shapes that would leave the canvas or
come within :data:`GAP` pixels of another shape fail the edit (touching shapes are no longer countable).

Appearance lives in the scene's optional ``style`` (``background``, ``noise``, ``noise_seed``, ``bar_width``,
``grid``); :func:`render` draws it and equals ``world.render`` on a scene without one.
"""

from __future__ import annotations

import copy
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

import numpy as np
from PIL import Image, ImageDraw

from core.toy.grammar import COLOURS, OBJECT_COLOURS
from core.toy_math import world
from core.toy_math.follow_up import exact_answer

__all__ = ["BACKGROUNDS", "InstructionError", "Op", "apply_ops", "edit_problem", "parse_instruction", "render"]

MAX_CLAUSES = 4
"""Most clauses per instruction (a long chain is more likely a generator's essay than an edit)."""
GAP = 2
"""Pixels an edited shape keeps clear of every other shape and of the canvas edge."""
MIN_SIDE = 8
"""Smallest side a shrunk shape may have (smaller ones stop being recognisable)."""

BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (255, 255, 255),
    "cream": (253, 246, 227),
    "beige": (245, 240, 225),
    "ivory": (255, 252, 240),
    "light blue": (228, 238, 252),
    "light green": (230, 246, 230),
    "light pink": (252, 234, 240),
    "light yellow": (252, 250, 220),
    "lavender": (238, 232, 250),
}
"""Background colours an instruction may ask for: all light (every channel >= 220), none an object colour, so shapes,
bars and the chart's grey grid lines (200) stay as distinct as on white."""
NOISE_RGB = (170, 170, 170)
NOISE_DENSITY = {"light": 0.01, "default": 0.02, "heavy": 0.04}
"""Share of background pixels that become grey specks."""
BAR_WIDTHS = {"default": 0.6, "thick": 0.8, "thin": 0.4}
"""A bar's width as a share of its slot (``world.render`` draws 0.6)."""
GRID_RGB = {"default": (200, 200, 200), "dark": (150, 150, 150)}


class InstructionError(ValueError):
    """The instruction cannot be applied with the answer kept: outside the grammar, not applicable to the scene,
    answer-changing, or a no-op. The caller keeps the previous row."""


@dataclass(frozen=True)
class Op:
    """One parsed clause. ``colour`` / ``noun`` select objects (``noun`` singular: exactly one must match)."""

    kind: str
    """``background``, ``noise``, ``recolour``, ``resize``, ``move``, ``bar_width`` or ``grid``."""
    value: Any = None
    """The background name, noise level, new colour, scale factor, (dx, dy), width name or grid name."""
    colour: str | None = None
    noun: str | None = None
    plural: bool = True


# --- parsing ---------------------------------------------------------------------------------------------------------

_COL = "|".join(OBJECT_COLOURS)
_BG = "|".join(sorted(BACKGROUNDS, key=len, reverse=True))
_NOUN = r"circles?|squares?|triangles?|diamonds?|cross(?:es)?|stars?|shapes?|objects?|bars?"
_SEL = rf"(?:all (?:of )?)?(?:the )?(?:(?P<c>{_COL}) )?(?P<n>{_NOUN})"
_PCT = r"(?: by (?P<pct>\d{1,3}) ?(?:%|percent))?"

_PATTERNS: list[tuple[str, re.Pattern]] = [
    (k, re.compile(p))
    for k, p in [
        ("background", rf"^(?:change|set|make|turn|paint|color|recolor) (?:the )?background(?: color)? "
                       rf"(?:to |into )?(?:be )?(?:an? )?(?P<bg>{_BG})(?: color)?$"),
        ("background", rf"^(?:use|give (?:it|the image)) (?:an? )?(?P<bg>{_BG}) background$"),
        ("noise", r"^add (?P<lvl>some |a little |light |a little bit of |heavy |a lot of |strong )?"
                  r"(?:grid |speckle |background |random |salt and pepper )?(?:noise|speckles|specks|grain)"
                  r"(?: to the (?:image|background|grid|chart|picture))?$"),
        ("grid", r"^(?:darken|thicken) the grid(?: lines)?$|^make the grid(?: lines)? darker$"),
        ("bar_width", r"^(?P<w>thicken|widen|thin|narrow) (?:all )?the bars$|"
                      r"^make (?:all )?the bars (?P<w2>thicker|wider|thinner|narrower)$"),
        ("recolour", rf"^(?:make|turn|color|recolor|paint|change) {_SEL} (?:to |into )?(?P<to>{_COL})$"),
        ("recolour", rf"^change the color of {_SEL} to (?P<to>{_COL})$"),
        ("resize", rf"^make {_SEL} (?P<slight>slightly |a bit |a little )?(?P<dir>bigger|larger|smaller){_PCT}$"),
        ("resize", rf"^(?P<verb>enlarge|shrink|grow|scale up|scale down) {_SEL}(?P<slight2> slightly)?{_PCT}$"),
        ("resize", rf"^(?P<verb2>increase|decrease|reduce) the size of {_SEL}(?P<slight3> slightly)?{_PCT}$"),
        ("move", rf"^(?:move|shift) {_SEL} (?:a bit |slightly |a little )?(?:to the |towards the )?"
                 rf"(?P<dir>left|right|up|down|upwards|downwards)(?: by (?P<px>\d{{1,3}}) ?(?:px|pixels?))?$"),
    ]
]  # fmt: skip


def _normalise(text: str) -> str:
    t = text.lower().replace("colour", "color").replace("grey", "gray").replace("’", "'")
    t = re.sub(r"\bplease\b|\bkindly\b", " ", t)
    t = re.sub(r"[\"'!?,:]+", " ", t)
    return re.sub(r"\s+", " ", t).strip()


def _clauses(text: str) -> list[str]:
    parts = re.split(r"[.;\n]|\band then\b|\bthen\b", text)
    return [p for p in (_normalise(p) for p in parts) if p]


def _noun(n: str) -> tuple[str, bool]:
    """(singular noun, plural?) of a selector noun."""
    if n in ("crosses", "cross"):
        return "cross", n == "crosses"
    return (n[:-1], True) if n.endswith("s") else (n, False)


def _parse_clause(clause: str) -> Op:
    for kind, pattern in _PATTERNS:
        m = pattern.match(clause)
        if m is None:
            continue
        g = m.groupdict()
        if kind == "background":
            return Op("background", g["bg"])
        if kind == "noise":
            lvl = (g["lvl"] or "").strip()
            level = "light" if lvl in ("a little", "light", "a little bit of") else "heavy" if lvl in (
                "heavy", "a lot of", "strong") else "default"  # fmt: skip
            return Op("noise", level)
        if kind == "grid":
            return Op("grid", "dark")
        if kind == "bar_width":
            word = g["w"] or g["w2"]
            return Op("bar_width", "thick" if word in ("thicken", "widen", "thicker", "wider") else "thin")
        noun, plural = _noun(g["n"])
        if kind == "recolour":
            return Op("recolour", g["to"], g["c"], noun, plural)
        if kind == "resize":
            word = g.get("dir") or g.get("verb") or g.get("verb2")
            grow = word in ("bigger", "larger", "enlarge", "grow", "scale up", "increase")
            slight = g.get("slight") or g.get("slight2") or g.get("slight3")
            pct = int(g["pct"]) if g.get("pct") else (10 if slight else 25)
            if not 5 <= pct <= 60:
                raise InstructionError(f"resize by {pct}% is outside 5-60% in clause {clause!r}")
            return Op("resize", 1 + pct / 100 if grow else 1 - pct / 100, g["c"], noun, plural)
        direction = g["dir"].removesuffix("wards")
        px = int(g["px"]) if g["px"] else None
        return Op("move", (direction, px), g["c"], noun, plural)
    raise InstructionError(
        f"instruction clause {clause!r} is outside the toy edit grammar (background, noise, recolour, enlarge / "
        "shrink, move, bar width, grid: see core.toy_math.edits)"
    )


def parse_instruction(text: str) -> list[Op]:
    """The ops of an instruction; raises :class:`InstructionError` for text outside the grammar."""
    clauses = _clauses(text)
    if not clauses:
        raise InstructionError("the instruction is empty")
    if len(clauses) > MAX_CLAUSES:
        raise InstructionError(f"the instruction has {len(clauses)} clauses, more than {MAX_CLAUSES}")
    return [_parse_clause(c) for c in clauses]


# --- execution -------------------------------------------------------------------------------------------------------


def _select(scene: dict[str, Any], op: Op) -> list[int]:
    """Indices of the objects (or bars) ``op`` selects; raises when none, or several for a singular selector."""
    is_bars = scene["kind"] == "bars"
    if (op.noun == "bar") != is_bars:
        what = "bars" if op.noun == "bar" else f"{op.noun}s"
        raise InstructionError(f"a {scene['kind']} scene has no {what} to {op.kind}")
    items = scene["bars"] if is_bars else scene["objects"]
    generic = op.noun in ("bar", "shape", "object")
    hits = [
        i for i, o in enumerate(items)
        if op.colour in (None, o["colour"]) and (generic or o["shape"] == op.noun)
    ]  # fmt: skip
    label = f"{op.colour + ' ' if op.colour else ''}{op.noun}"
    if not hits:
        raise InstructionError(f"no {label} in the scene")
    if not op.plural and len(hits) > 1:
        raise InstructionError(f"'the {label}' is ambiguous: {len(hits)} objects match")
    return hits


def _check_layout(scene: dict[str, Any]) -> None:
    size, boxes = scene["size"], [o["box"] for o in scene["objects"]]
    for i, (x1, y1, x2, y2) in enumerate(boxes):
        if x1 < GAP or y1 < GAP or x2 > size - GAP or y2 > size - GAP:
            raise InstructionError(f"the edit puts a shape at {[x1, y1, x2, y2]}, off the {size} x {size} canvas")
        for bx1, by1, bx2, by2 in boxes[:i]:
            if x1 < bx2 + GAP and bx1 < x2 + GAP and y1 < by2 + GAP and by1 < y2 + GAP:
                raise InstructionError(
                    f"the edit makes shapes at {[x1, y1, x2, y2]} and {[bx1, by1, bx2, by2]} touch, so they could no "
                    "longer be counted"
                )


def _apply(scene: dict[str, Any], op: Op, seed: int) -> None:
    style = scene.setdefault("style", {})
    if op.kind == "background":
        style["background"] = op.value
    elif op.kind == "noise":
        style["noise"], style["noise_seed"] = NOISE_DENSITY[op.value], int(seed)
    elif op.kind in ("grid", "bar_width"):
        if scene["kind"] != "bars":
            raise InstructionError(f"a {op.kind.replace('_', ' ')} edit needs a bar chart, not a {scene['kind']} scene")
        style[op.kind] = op.value
    elif op.kind == "recolour":
        hits = _select(scene, op)
        if scene["kind"] == "bars":
            if len(hits) != 1:
                raise InstructionError("recolour one bar at a time (name it by its colour)")
            if any(b["colour"] == op.value for b in scene["bars"]):
                raise InstructionError(f"a {op.value} bar is already in the chart: bar colours must stay distinct")
            scene["bars"][hits[0]]["colour"] = op.value
        else:
            for i in hits:
                scene["objects"][i]["colour"] = op.value
    elif op.kind == "resize":
        for i in _select(scene, op):
            x1, y1, x2, y2 = scene["objects"][i]["box"]
            w, h = round((x2 - x1) * op.value), round((y2 - y1) * op.value)
            if min(w, h) < MIN_SIDE:
                raise InstructionError(f"shrinking the shape at {[x1, y1, x2, y2]} leaves it under {MIN_SIDE} px")
            cx, cy = (x1 + x2) / 2, (y1 + y2) / 2
            nx, ny = int(round(cx - w / 2)), int(round(cy - h / 2))
            scene["objects"][i]["box"] = [nx, ny, nx + w, ny + h]
        _check_layout(scene)
    elif op.kind == "move":
        direction, px = op.value
        step = px if px is not None else max(4, round(scene["size"] * 0.06))
        if not 1 <= step <= scene["size"] // 2:
            raise InstructionError(f"a move of {step} px is outside 1-{scene['size'] // 2} px")
        dx, dy = {"left": (-step, 0), "right": (step, 0), "up": (0, -step), "down": (0, step)}[direction]
        for i in _select(scene, op):
            x1, y1, x2, y2 = scene["objects"][i]["box"]
            scene["objects"][i]["box"] = [x1 + dx, y1 + dy, x2 + dx, y2 + dy]
        _check_layout(scene)
    else:
        raise InstructionError(f"unknown op {op.kind!r}")


def apply_ops(scene: dict[str, Any], ops: list[Op], seed: int = 0) -> dict[str, Any]:
    """The scene after ``ops`` (a new dict; ``scene`` is not modified). ``seed`` places the noise specks."""
    if scene.get("kind") not in ("shapes", "bars"):
        raise InstructionError(f"a toy math scene has kind shapes or bars, got {scene.get('kind')!r}")
    out = copy.deepcopy(scene)
    for op in ops:
        _apply(out, op, seed)
    if not out.get("style"):
        out.pop("style", None)
    return out


# --- rendering -------------------------------------------------------------------------------------------------------


def _render_bars(scene: dict[str, Any], width: float, grid: tuple[int, int, int]) -> Image.Image:
    """``world.render``'s bar chart with the bar width (share of the slot) and grid colour as parameters."""
    s = scene["size"]
    image = Image.new("RGB", (s, s), (255, 255, 255))
    draw = ImageDraw.Draw(image)
    left, top, right, bottom, unit = world._chart_geometry(scene)
    for v in range(1, scene["max_value"] + 1):
        y = round(bottom - v * unit)
        draw.line([(left, y), (right, y)], fill=grid, width=1)
    slot, margin = (right - left) / len(scene["bars"]), (1 - width) / 2
    for i, bar in enumerate(scene["bars"]):
        x1, x2 = round(left + (i + margin) * slot), round(left + (i + 1 - margin) * slot)
        draw.rectangle([x1, round(bottom - bar["value"] * unit), x2, bottom], fill=COLOURS[bar["colour"]])
    draw.line([(left, top), (left, bottom), (right, bottom)], fill=(0, 0, 0), width=2)
    return image


def render(scene: dict[str, Any]) -> Image.Image:
    """The scene's image with its ``style`` applied; ``world.render(scene)`` when it has none."""
    style = scene.get("style") or {}
    if scene["kind"] == "bars" and ("bar_width" in style or "grid" in style):
        image = _render_bars(
            scene, BAR_WIDTHS[style.get("bar_width", "default")], GRID_RGB[style.get("grid", "default")]
        )
    else:
        image = world.render(scene)
    if "background" not in style and "noise" not in style:
        return image
    arr = np.array(image)
    background = (arr == 255).all(-1)  # the world draws nothing pure white but the background
    arr[background] = BACKGROUNDS[style.get("background", "white")]
    if style.get("noise"):
        rng = np.random.default_rng(int(style.get("noise_seed", 0)))
        arr[background & (rng.random(background.shape) < float(style["noise"]))] = NOISE_RGB
    return Image.fromarray(arr)


# --- the answer check ------------------------------------------------------------------------------------------------


def _signature(scene: dict[str, Any]) -> Counter:
    """What every problem of the world is computed from: (colour, shape) counts, or the bars' (colour, value)."""
    if scene["kind"] == "bars":
        return Counter((b["colour"], b["value"]) for b in scene["bars"])
    return Counter((o["colour"], o["shape"]) for o in scene["objects"])


def _answer(scene: dict[str, Any], meta: dict[str, Any]) -> int | str | None:
    """The problem's exact answer on ``scene``; None when the problem no longer makes sense there (a bar it names is
    gone) or is ambiguous (a most-colour question whose top colours tie)."""
    try:
        answer = exact_answer(scene, meta)
    except (KeyError, ValueError):
        return None
    if meta["query"]["op"] == "most_choice":
        counts = Counter(o["colour"] for o in scene["objects"])
        top = sorted((counts[c] for c in meta["query"]["options"]), reverse=True)
        if len(top) > 1 and top[0] == top[1]:
            return None
    return answer


def edit_problem(problem: dict[str, Any], instruction: str, seed: int = 0) -> dict[str, Any]:
    """Apply ``instruction`` to a toy math problem and check that its answer is kept.

    ``problem`` is a toy math row's ``meta`` (``scene``, ``query``, optional ``follow_ups``: the problem's answer is
    re-derived on the edited scene and must be the same) or a bare scene (then no problem is known, so every answer
    the world could ask must be kept: the (colour, shape) counts, or the bars' colours and values). Returns the same
    form with the edited scene. Raises :class:`InstructionError` outside the grammar, when the edit does not apply to
    the scene, would change the answer, or would change nothing in the image.
    """
    has_problem = "scene" in problem
    scene = problem["scene"] if has_problem else problem
    if has_problem and "query" not in problem:
        raise InstructionError("a toy math problem needs its query beside its scene (the row's meta)")
    edited = apply_ops(scene, parse_instruction(instruction), seed)
    if has_problem:
        before, after = _answer(scene, problem), _answer(edited, problem)
        if after is None or after != before:
            shown = "undefined" if after is None else repr(str(after))
            raise InstructionError(f"the edit would change the answer from {str(before)!r} to {shown}: {instruction!r}")
    elif _signature(edited) != _signature(scene):
        raise InstructionError(f"the edit changes what the scene's problems count (no problem given): {instruction!r}")
    if np.array_equal(np.asarray(render(edited)), np.asarray(render(scene))):
        raise InstructionError(f"the edit changes nothing in the image: {instruction!r}")
    return {**problem, "scene": edited} if has_problem else edited
