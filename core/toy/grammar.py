"""The description grammar: what a model may ask the procedural painter to paint.

A *description* names a background (a texture and one or two colours) and one group of distractor shapes
(count, size, colour, shape)::

    a striped blue and white background with many small green triangles
    a plain white background with no distractors

Two parts of the project speak it: the toy world builds every scene as "foreground objects + a description rendered
around them", and the data server's procedural painter repaints a sample from the description a model wrote in its
``<description>`` tag. So the text form is a contract:

- ``format_description(d)`` writes the canonical text and ``parse_description(format_description(d)) == d`` for every
  ``Description`` (the dataclass normalises itself, so there is exactly one value per canonical text);
- ``parse_description`` is lenient on free text from a model: it finds grammar words anywhere, case-insensitive, with
  a few synonyms ("grey", "big", "stripes", "lots"), fills defaults for what is missing, returns ``None`` only when the
  text holds no background, colour or shape word, and never raises;
- ``render(image, keep_mask, description, seed)`` paints the background and the distractors wherever ``keep_mask``
  is False and leaves every kept pixel bit-identical (the composite with the mask is the last step).

Shapes are drawn with hard edges (no anti-aliasing) so that a box is exactly the extent of the drawn pixels and a
kept pixel is either the object's colour or untouched; ``draw_shape`` is the one drawing routine for the toy world's
objects and the painter's distractors, so an object looks the same everywhere.
"""

from __future__ import annotations

import functools
import math
import re
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
from PIL import Image

BACKGROUNDS = ("plain", "gradient", "striped", "checkered", "noisy", "dotted")
"""Background textures. The toy world's in-domain splits use the first two, the OOD split the textured rest."""
PLAIN_BACKGROUNDS = ("plain", "gradient")
TEXTURED_BACKGROUNDS = ("striped", "checkered", "noisy", "dotted")

COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 40, 40),
    "green": (40, 170, 60),
    "blue": (40, 80, 220),
    "yellow": (240, 210, 40),
    "orange": (245, 140, 30),
    "purple": (140, 60, 190),
    "pink": (245, 130, 190),
    "cyan": (40, 200, 210),
    "brown": (130, 80, 40),
    "white": (245, 245, 245),
    "black": (20, 20, 20),
    "gray": (128, 128, 128),
}
"""Named RGB colours. Every name may colour a background or a distractor."""
OBJECT_COLOURS = ("red", "green", "blue", "yellow", "orange", "purple", "pink", "cyan")
"""The saturated colours the toy world gives its objects; the neutral rest stays free for backgrounds."""

SHAPES = ("circle", "square", "triangle", "diamond", "cross", "star")
SIZES = ("small", "large")
SIZE_FRACTIONS: dict[str, tuple[float, float]] = {"small": (0.08, 0.12), "large": (0.19, 0.27)}
"""Side of a shape's box as a fraction of the image's shorter side (a gap between the two keeps them nameable)."""

COUNTS = ("no", "few", "some", "many")
COUNT_RANGES: dict[str, tuple[int, int]] = {"no": (0, 0), "few": (1, 3), "some": (4, 6), "many": (7, 10)}
"""How many distractors each count word paints (inclusive)."""

_DEFAULT_DISTRACTOR_COLOURS = ("red", "blue", "black")


def count_word(n: int) -> str:
    """The count word whose range holds ``n`` (anything above the ranges is "many")."""
    for word in COUNTS:
        lo, hi = COUNT_RANGES[word]
        if lo <= n <= hi:
            return word
    if n < 0:
        raise ValueError(f"a distractor count must be >= 0, got {n}")
    return "many"


def plural(shape: str) -> str:
    return shape + ("es" if shape.endswith("s") else "s")


def _check(name: str, value: object, allowed: tuple[str, ...] | dict) -> None:
    if value not in allowed:
        raise ValueError(f"Description.{name} must be one of {tuple(allowed)}, got {value!r}")


@dataclass(frozen=True)
class Description:
    """A background and one group of distractors; ``str(d)`` is the canonical text.

    The constructor normalises, so that every value has one canonical text: with ``count="no"`` the distractor
    fields become None; with any other count the missing ones are filled (circle, small, a colour unlike the
    background's).
    """

    background: str = "plain"
    """Texture, one of BACKGROUNDS."""
    colour: str = "white"
    """First background colour (the only one a plain background shows)."""
    colour2: str | None = None
    """Second background colour; None lets a texture pick black or white, whichever contrasts with ``colour``."""
    count: str = "no"
    """Count word for the distractors, one of COUNTS (ranges in COUNT_RANGES)."""
    shape: str | None = None
    """Distractor shape, one of SHAPES (None exactly when count is "no")."""
    shape_colour: str | None = None
    """Distractor colour, a key of COLOURS (None exactly when count is "no")."""
    size: str | None = None
    """Distractor size, one of SIZES (None exactly when count is "no")."""

    def __post_init__(self) -> None:
        _check("background", self.background, BACKGROUNDS)
        _check("colour", self.colour, COLOURS)
        if self.colour2 is not None:
            _check("colour2", self.colour2, COLOURS)
        _check("count", self.count, COUNTS)
        if self.count == "no":
            for name in ("shape", "shape_colour", "size"):
                object.__setattr__(self, name, None)
            return
        if self.shape is None:
            object.__setattr__(self, "shape", SHAPES[0])
        if self.size is None:
            object.__setattr__(self, "size", SIZES[0])
        if self.shape_colour is None:
            taken = {self.colour, self.colour2}
            object.__setattr__(self, "shape_colour", next(c for c in _DEFAULT_DISTRACTOR_COLOURS if c not in taken))
        _check("shape", self.shape, SHAPES)
        _check("shape_colour", self.shape_colour, COLOURS)
        _check("size", self.size, SIZES)

    def __str__(self) -> str:
        return format_description(self)


def format_description(d: Description) -> str:
    """Canonical text, e.g. "a striped blue and white background with many small green triangles"."""
    colours = d.colour if d.colour2 is None else f"{d.colour} and {d.colour2}"
    if d.count == "no":
        distractors = "no distractors"
    else:
        distractors = f"{d.count} {d.size} {d.shape_colour} {plural(d.shape)}"
    return f"a {d.background} {colours} background with {distractors}"


def random_description(rng: np.random.Generator) -> Description:
    """A uniformly random description: distinct background colours (only textures get a second one), a distractor
    colour unlike the background's, every count word equally likely."""
    names = list(COLOURS)
    background = BACKGROUNDS[rng.integers(len(BACKGROUNDS))]
    colour = names[rng.integers(len(names))]
    colour2 = None
    if background != "plain":
        rest = [c for c in names if c != colour]
        colour2 = rest[rng.integers(len(rest))]
    count = COUNTS[rng.integers(len(COUNTS))]
    if count == "no":
        return Description(background, colour, colour2)
    free = [c for c in names if c not in (colour, colour2)]
    return Description(
        background,
        colour,
        colour2,
        count,
        SHAPES[rng.integers(len(SHAPES))],
        free[rng.integers(len(free))],
        SIZES[rng.integers(len(SIZES))],
    )


# --- lenient parsing -------------------------------------------------------------------------------------------------


def _lexicon() -> dict[str, tuple[str, str]]:
    """word -> (category, canonical value). Categories: kind, colour, shape, size, count, bg (a background noun),
    obj (a noun for distractors)."""
    lex: dict[str, tuple[str, str]] = {}
    synonyms = {
        "kind": {
            "plain": "plain solid uniform flat blank empty",
            "gradient": "gradient gradients fading fade ombre",
            "striped": "striped stripes stripe stripy lined",
            "checkered": "checkered chequered checkerboard checker checked checks tiled",
            "noisy": "noisy noise grainy speckled mottled static",
            "dotted": "dotted dots dot spotted spots polka dotty",
        },
        "colour": {c: c for c in COLOURS}
        | {
            "gray": "gray grey",
            "purple": "purple violet",
            "pink": "pink magenta",
            "cyan": "cyan teal turquoise aqua",
            "yellow": "yellow gold golden",
            "green": "green lime",
            "blue": "blue navy",
        },
        "shape": {
            "circle": "circle disc disk round",
            "square": "square rectangle",
            "triangle": "triangle",
            "diamond": "diamond rhombus",
            "cross": "cross plus",
            "star": "star",
        },
        "size": {"small": "small tiny little mini", "large": "large big huge giant"},
        "count": {
            "no": "no none zero without",
            "few": "few couple single one two three",
            "some": "some several multiple four five six",
            "many": "many lots numerous plenty crowded cluttered busy dozens countless seven eight nine ten",
        },
        "bg": {"": "background backgrounds backdrop pattern texture canvas"},
        "obj": {"": "distractor distractors shape shapes object objects thing things item items"},
    }
    for category, table in synonyms.items():
        for canonical, words in table.items():
            for word in words.split():
                lex[word] = (category, canonical)
                if category == "shape":
                    lex[plural(word)] = (category, canonical)
    return lex


_LEXICON = _lexicon()
_TOKEN = re.compile(r"[a-z]+|[0-9]+")
_NOUNS = ("kind", "shape", "bg", "obj")


def parse_description(text: str) -> Description | None:
    """Read a description from free text; exact on canonical text, lenient otherwise, never raises.

    Each colour word binds to the next noun-like word after it: a shape or "distractors" / "shapes" makes it the
    distractors' colour, a texture or "background" a background colour (with no noun after it: background first).
    The first texture, size, shape and count word win; missing parts take defaults (plain white background; a
    distractor group mentioned without a count is "some"). Returns None when the text has no texture, colour or shape
    word at all.
    """
    if not isinstance(text, str):
        return None
    tagged: list[tuple[str, str]] = []
    for tok in _TOKEN.findall(text.lower()):
        if tok.isdigit():
            if len(tok) <= 3:
                tagged.append(("count", count_word(int(tok))))
        elif tok in _LEXICON:
            tagged.append(_LEXICON[tok])
    if not any(cat in ("kind", "colour", "shape") for cat, _ in tagged):
        return None

    # next_noun[i]: category of the first noun-like word after position i
    next_noun: list[str | None] = [None] * len(tagged)
    following: str | None = None
    for i in range(len(tagged) - 1, -1, -1):
        next_noun[i] = following
        if tagged[i][0] in _NOUNS:
            following = tagged[i][0]

    first: dict[str, str] = {}
    bg_colours: list[str] = []
    shape_colour: str | None = None
    for (cat, value), noun in zip(tagged, next_noun):
        first.setdefault(cat, value)
        if cat != "colour":
            continue
        to_distractors = noun in ("shape", "obj") or (noun is None and len(bg_colours) >= 2)
        if to_distractors:
            shape_colour = shape_colour or value
        elif len(bg_colours) < 2:
            bg_colours.append(value)

    background = first.get("kind", "plain")
    if not bg_colours:
        bg_colours = ["black" if shape_colour == "white" else "white"]
    colour, colour2 = bg_colours[0], (bg_colours[1] if len(bg_colours) > 1 else None)
    mentions_distractors = shape_colour is not None or any(cat in ("shape", "obj") for cat, _ in tagged)
    count = first.get("count", "some" if mentions_distractors else "no")
    if count == "no":
        return Description(background, colour, colour2)
    return Description(background, colour, colour2, count, first.get("shape"), shape_colour, first.get("size"))


def as_description(description: Description | str) -> Description:
    """A Description from a Description or text; raises ValueError when the text names nothing of the grammar."""
    if isinstance(description, Description):
        return description
    parsed = parse_description(description)
    if parsed is None:
        raise ValueError(f"no background, colour or shape word in the description {description!r}")
    return parsed


# --- drawing ---------------------------------------------------------------------------------------------------------


def _polygon_mask(vertices: np.ndarray, w: int, h: int, tol: float = 0.75) -> np.ndarray:
    """Pixels whose centre lies inside the polygon or within ``tol`` pixels of its outline; the tolerance makes sharp
    tips that touch the box edge light a pixel, so the drawn extent fills the box."""
    xs = np.arange(w, dtype=np.float64)[None, :] + 0.5  # [1, w]
    ys = np.arange(h, dtype=np.float64)[:, None] + 0.5  # [h, 1]
    inside = np.zeros((h, w), dtype=bool)
    near = np.full((h, w), np.inf)
    for (ax, ay), (bx, by) in zip(vertices, np.roll(vertices, -1, axis=0)):
        dx, dy = bx - ax, by - ay
        if dy != 0:  # even-odd crossing test on a ray towards -x
            crosses = (ay > ys) != (by > ys)
            x_at = ax + (ys - ay) * dx / dy
            inside ^= crosses & (xs < x_at)
        t = np.clip(((xs - ax) * dx + (ys - ay) * dy) / max(dx * dx + dy * dy, 1e-12), 0.0, 1.0)
        near = np.minimum(near, (xs - ax - t * dx) ** 2 + (ys - ay - t * dy) ** 2)
    return inside | (near <= tol * tol)


def _star(w: int, h: int) -> np.ndarray:
    angles = -np.pi / 2 + np.arange(10) * np.pi / 5
    radii = np.where(np.arange(10) % 2 == 0, 1.0, 0.5)
    pts = np.stack([radii * np.cos(angles), radii * np.sin(angles)], axis=1)
    lo, hi = pts.min(0), pts.max(0)
    return (pts - lo) / (hi - lo) * np.array([w, h])


@functools.lru_cache(maxsize=4096)
def shape_mask(shape: str, w: int, h: int) -> np.ndarray:
    """Bool ``[h, w]`` mask of ``shape`` drawn in a ``w x h`` box; every border row and column holds a pixel, so the
    box is tight. Cached and read-only."""
    _check("shape", shape, SHAPES)
    if w < 1 or h < 1:
        raise ValueError(f"a shape box must be at least 1x1 pixels, got {w}x{h}")
    xs = np.arange(w, dtype=np.float64)[None, :] + 0.5
    ys = np.arange(h, dtype=np.float64)[:, None] + 0.5
    cx, cy = w / 2, h / 2
    if shape == "square":
        mask = np.ones((h, w), dtype=bool)
    elif shape == "circle":
        mask = ((xs - cx) / cx) ** 2 + ((ys - cy) / cy) ** 2 <= 1.0 + 1e-9
    elif shape == "cross":
        mask = (np.abs(xs - cx) <= max(w / 6, 0.5)) | (np.abs(ys - cy) <= max(h / 6, 0.5))
    elif shape == "triangle":
        mask = _polygon_mask(np.array([[cx, 0], [w, h], [0, h]]), w, h)
    elif shape == "diamond":
        mask = _polygon_mask(np.array([[cx, 0], [w, cy], [cx, h], [0, cy]]), w, h)
    else:
        mask = _polygon_mask(_star(w, h), w, h)
    mask = np.ascontiguousarray(np.broadcast_to(mask, (h, w)))
    mask.flags.writeable = False
    return mask


Box = tuple[int, int, int, int]


def draw_shape(
    target: np.ndarray | Image.Image,
    shape: str,
    colour: str | tuple[int, int, int],
    box: tuple[float, float, float, float] | list[float],
    mask: np.ndarray | None = None,
) -> Box | None:
    """Draw a filled ``shape`` in ``box`` (``[x1, y1, x2, y2]``, pixels ``x1 <= x < x2``) onto ``target`` in place.

    ``target`` is an ``[H, W, 3]`` uint8 array or an RGB PIL image; ``colour`` a name from COLOURS or an RGB triple.
    Parts outside the canvas are clipped. If ``mask`` (bool ``[H, W]``) is given, the drawn pixels are OR-ed into it.
    Returns the tight box of the pixels drawn on the canvas, or None when none landed on it.
    """
    rgb = COLOURS[colour] if isinstance(colour, str) else tuple(int(c) for c in colour)
    if isinstance(target, Image.Image):
        arr = np.array(target.convert("RGB"))
        drawn = draw_shape(arr, shape, rgb, box, mask)
        if drawn is not None:
            target.paste(Image.fromarray(arr[drawn[1] : drawn[3], drawn[0] : drawn[2]]), drawn[:2])
        return drawn
    x1, y1, x2, y2 = (int(round(v)) for v in box)
    local = shape_mask(shape, x2 - x1, y2 - y1)
    h, w = target.shape[:2]
    cx1, cy1, cx2, cy2 = max(x1, 0), max(y1, 0), min(x2, w), min(y2, h)
    if cx1 >= cx2 or cy1 >= cy2:
        return None
    sub = local[cy1 - y1 : cy2 - y1, cx1 - x1 : cx2 - x1]
    target[cy1:cy2, cx1:cx2][sub] = rgb
    if mask is not None:
        mask[cy1:cy2, cx1:cx2] |= sub
    rows, cols = np.flatnonzero(sub.any(1)), np.flatnonzero(sub.any(0))
    if rows.size == 0:
        return None
    return (cx1 + int(cols[0]), cy1 + int(rows[0]), cx1 + int(cols[-1]) + 1, cy1 + int(rows[-1]) + 1)


# --- rendering -------------------------------------------------------------------------------------------------------


class Placed(NamedTuple):
    """A distractor the painter drew: its attributes and tight box ``(x1, y1, x2, y2)`` in pixels."""

    shape: str
    colour: str
    size: str
    box: Box


def _contrast(colour: str) -> str:
    r, g, b = COLOURS[colour]
    return "black" if 0.299 * r + 0.587 * g + 0.114 * b > 140 else "white"


def _upsample(coarse: np.ndarray, h: int, w: int) -> np.ndarray:
    """Bilinear resize of a small ``[gh, gw]`` grid to ``[h, w]``."""
    gh, gw = coarse.shape
    ys, xs = np.linspace(0, gh - 1, h), np.linspace(0, gw - 1, w)
    y0, x0 = np.floor(ys).astype(int), np.floor(xs).astype(int)
    y1, x1 = np.minimum(y0 + 1, gh - 1), np.minimum(x0 + 1, gw - 1)
    fy, fx = (ys - y0)[:, None], (xs - x0)[None, :]
    rows = coarse[y0] * (1 - fy) + coarse[y1] * fy  # [h, gw]
    return rows[:, x0] * (1 - fx) + rows[:, x1] * fx  # [h, w]


def _background(d: Description, w: int, h: int, rng: np.random.Generator) -> np.ndarray:
    """``[h, w, 3]`` uint8 background: ``colour + (colour2 - colour) * t`` with a texture field ``t`` in [0, 1]."""
    c1 = np.array(COLOURS[d.colour], dtype=np.float32)
    c2 = np.array(COLOURS[d.colour2 or _contrast(d.colour)], dtype=np.float32)
    scale = min(w, h) / 224
    xs = np.arange(w, dtype=np.float32)[None, :]
    ys = np.arange(h, dtype=np.float32)[:, None]
    if d.background == "plain":
        return np.broadcast_to(c1.astype(np.uint8), (h, w, 3)).copy()
    if d.background == "gradient":
        a = rng.uniform(0, 2 * math.pi)
        proj = xs * math.cos(a) + ys * math.sin(a)
        t = (proj - proj.min()) / max(float(proj.max() - proj.min()), 1.0)
    elif d.background == "striped":
        period = max(4.0, float(rng.integers(10, 27)) * scale)
        a = math.radians(float(rng.choice([0, 45, 90, 135])))
        proj = xs * math.cos(a) + ys * math.sin(a) + rng.uniform(0, period)
        t = np.floor(proj / (period / 2)) % 2
    elif d.background == "checkered":
        cell = max(2.0, float(rng.integers(8, 25)) * scale)
        ox, oy = rng.uniform(0, cell, size=2)
        t = (np.floor((xs + ox) / cell) + np.floor((ys + oy) / cell)) % 2
    elif d.background == "noisy":
        coarse = rng.random((max(2, h // 16), max(2, w // 16)))
        t = np.clip(0.7 * _upsample(coarse, h, w) + 0.3 * rng.random((h, w)), 0.0, 1.0)
    else:  # dotted
        spacing = max(4.0, float(rng.integers(10, 21)) * scale)
        radius = rng.uniform(0.2, 0.32) * spacing
        ox, oy = rng.uniform(0, spacing, size=2)
        dx = (xs + ox) % spacing - spacing / 2
        dy = (ys + oy) % spacing - spacing / 2
        t = (dx * dx + dy * dy <= radius * radius).astype(np.float32)
    t = np.broadcast_to(t, (h, w)).astype(np.float32)[..., None]
    return np.rint(c1 + (c2 - c1) * t).astype(np.uint8)


def _integral(mask: np.ndarray) -> np.ndarray:
    out = np.zeros((mask.shape[0] + 1, mask.shape[1] + 1), dtype=np.int64)
    out[1:, 1:] = mask.cumsum(0, dtype=np.int64).cumsum(1)
    return out


def _layout(
    d: Description, w: int, h: int, avoid: np.ndarray, rng: np.random.Generator, n: int | None, candidates: int = 64
) -> list[tuple[str, str, str, Box]]:
    """Square boxes for the distractors: each takes, among ``candidates`` random positions, the first that overlaps
    ``avoid`` and the distractors placed before it the least (so it only lands on kept pixels when nothing else fits)."""
    if d.count == "no":
        if n:
            raise ValueError(f"n_distractors={n} with a description that says 'no distractors'")
        return []
    lo, hi = COUNT_RANGES[d.count]
    n = int(rng.integers(lo, hi + 1)) if n is None else int(n)
    ii = _integral(avoid)
    short = min(w, h)
    gap = max(1, round(2 * short / 224))
    flo, fhi = SIZE_FRACTIONS[d.size]
    taken = np.zeros((0, 4), dtype=np.int64)  # boxes placed so far, grown by the gap
    boxes = []
    for _ in range(n):
        side = int(np.clip(round(rng.uniform(flo, fhi) * short), 3, short))
        x1 = rng.integers(0, w - side + 1, size=candidates)
        y1 = rng.integers(0, h - side + 1, size=candidates)
        x2, y2 = x1 + side, y1 + side
        overlap = ii[y2, x2] - ii[y1, x2] - ii[y2, x1] + ii[y1, x1]  # [candidates] avoided pixels covered
        if len(taken):
            iw = np.minimum(x2[:, None], taken[None, :, 2]) - np.maximum(x1[:, None], taken[None, :, 0])
            ih = np.minimum(y2[:, None], taken[None, :, 3]) - np.maximum(y1[:, None], taken[None, :, 1])
            overlap = overlap + (np.clip(iw, 0, None) * np.clip(ih, 0, None)).sum(1)  # [candidates]
        j = int(np.argmin(overlap))
        box = (int(x1[j]), int(y1[j]), int(x2[j]), int(y2[j]))
        taken = np.vstack([taken, [[box[0] - gap, box[1] - gap, box[2] + gap, box[3] + gap]]])
        boxes.append((d.shape, d.shape_colour, d.size, box))
    return boxes


def render_with_layout(
    image: Image.Image,
    keep_mask: np.ndarray,
    description: Description | str,
    seed: int,
    *,
    n_distractors: int | None = None,
    avoid_mask: np.ndarray | None = None,
) -> tuple[Image.Image, list[Placed]]:
    """``render`` that also returns the distractors it drew (``Placed``, boxes before compositing).

    ``n_distractors`` overrides the number drawn from the count word's range; ``avoid_mask`` (bool ``[H, W]``,
    default ``keep_mask``) is where distractors should not go (the toy world passes its objects' boxes).
    """
    d = as_description(description)
    src = np.asarray(image.convert("RGB"))
    h, w = src.shape[:2]
    keep = np.asarray(keep_mask).astype(bool, copy=False)
    if keep.shape != (h, w):
        raise ValueError(f"keep_mask must be a bool [H, W] = [{h}, {w}] array like the image, got shape {keep.shape}")
    avoid = keep if avoid_mask is None else np.asarray(avoid_mask).astype(bool, copy=False)
    if avoid.shape != (h, w):
        raise ValueError(f"avoid_mask must have shape [{h}, {w}], got {avoid.shape}")
    # Independent streams: the background texture never shifts where the distractors go.
    bg_seq, layout_seq = np.random.SeedSequence(int(seed) % 2**64).spawn(2)
    canvas = _background(d, w, h, np.random.default_rng(bg_seq))
    placed = []
    for shape, colour, size, box in _layout(d, w, h, avoid, np.random.default_rng(layout_seq), n_distractors):
        drawn = draw_shape(canvas, shape, colour, box)
        if drawn is not None:
            placed.append(Placed(shape, colour, size, drawn))
    out = np.where(keep[..., None], src, canvas)  # last step: kept pixels are the input's, bit for bit
    return Image.fromarray(out, "RGB"), placed


def render(
    image: Image.Image,
    keep_mask: np.ndarray,
    description: Description | str,
    seed: int,
    *,
    n_distractors: int | None = None,
    avoid_mask: np.ndarray | None = None,
) -> Image.Image:
    """Paint ``description`` (background, then distractors) everywhere ``keep_mask`` is False.

    Returns a new RGB image of the input's size; pixels where ``keep_mask`` is True equal ``image.convert("RGB")``
    bit for bit. Deterministic per (description, seed, size, mask). A text description is parsed leniently; text with
    no grammar word raises ValueError.
    """
    return render_with_layout(image, keep_mask, description, seed, n_distractors=n_distractors, avoid_mask=avoid_mask)[
        0
    ]
