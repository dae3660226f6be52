"""Planning EvolvedGRPO's question edits on the toy world (and on real images): which harder or easier version of a
question to make. The plans are pure functions of the scene and an rng; a visual plan is a job that
``core.toy.edits.execute_job`` (here, or the data server) runs.

- **Textual edits** (``edit_query``): a new referring expression for the *same* target object, unique in the scene
  under the query semantics of ``core.toy.query``, by level: attributes (+ a location), negation, one spatial
  relation, ordinal (counting), two-hop relation. ``None`` when no such query exists at that level: never an
  ambiguous one.
- **Visual edits** (``plan_visual_edit`` -> a job dict ``{"kind", "params"}``): closer look-alikes of the target,
  clutter (a textured background with more painted distractors), occlusion of non-target objects, and the visual
  sub-problems "declutter" and, easier, "isolate" or "zoom". The job holds everything needed to re-render (boxes,
  description, seeds), so a data server can execute it. Each plan is executed here and kept only if the query stays
  exact.
- **Real images** (``plan_inpaint``): an ``inpaint`` job that paints clutter around the target.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

from core.regions.boxes import box_intersection
from core.toy import grammar
from core.toy.edits import (
    ISOLATE_KIND,
    NEUTRALS,
    SUB_VISUAL_KIND,
    SUB_VISUAL_KINDS,
    VISUAL_KINDS,
    ZOOM_FACTOR,
    ZOOM_KIND,
    _zoom_window,
    execute_job,
)
from core.toy.grammar import COLOURS, OBJECT_COLOURS, SHAPES, SIZE_FRACTIONS, SIZES, Description
from core.toy.query import (
    ATTRS,
    NP,
    ORDINALS,
    RELATIONS,
    SIDES,
    Desc,
    _base,
    _descs,
    _in_region,
    _nps,
    _ordered,
    _related,
    format_query,
    minimal_np,
    parse_query,
    query_problem,
    resolve,
)
from core.toy.scene import Visibility, _foreground, _objects, first_free_square, target_index, visibility

TEXT_KINDS = ("original", "attributes", "negation", "relation", "ordinal", "multihop")
"""Textual edit kinds; the index is the level (``TEXT_KINDS[level]``)."""
MAX_LEVEL = len(TEXT_KINDS) - 1


# --- textual edits ---------------------------------------------------------------------------------------------------


def _candidates(meta: dict[str, Any], kind: str, vis: Sequence[Visibility]) -> Iterator[NP]:
    """Queries of ``kind`` that are true of the target, in no particular order; the caller filters for exactness."""
    objects, w, h = _objects(meta), meta["width"], meta["height"]
    t = target_index(meta)
    target = objects[t]

    def ambiguous(d: Desc) -> bool:  # the descriptor alone names more than the target: the extra part is needed
        return len(_base(NP(d), objects, w, h)) >= 2

    if kind == "original":
        yield NP(Desc(target["size"], target["colour"], target["shape"]))
    elif kind == "attributes":
        for side in SIDES:
            if _in_region(side, target["box"], w, h):
                for d in _descs(target, 1):
                    if ambiguous(d):  # the location is needed to tell the target apart
                        yield NP(d, region=side)
                yield NP(Desc(target["size"], target["colour"], target["shape"]), region=side)  # one attribute more
    elif kind == "negation":
        for d in _descs(target):
            if not ambiguous(d):
                continue
            for attr in ATTRS:
                if getattr(d, attr) is not None:
                    continue
                for value in sorted({objects[i][attr] for i in _base(NP(d), objects, w, h)} - {target[attr]}):
                    yield NP(d, negate=(attr, value))
    elif kind in ("relation", "multihop"):
        named = {j: minimal_np(meta, j, vis) for j in range(len(objects)) if j != t}
        anchors = [(j, a) for j, a in named.items() if a is not None]
        if kind == "multihop":  # the middle hop: an object named through its own relation to an anchor
            middles: list[tuple[int, NP]] = []
            for m in range(len(objects)):
                if m == t or vis[m] != "clear":
                    continue
                for d in _descs(objects[m]):
                    if not ambiguous(d):
                        continue
                    for j, a in anchors:
                        if j == m:
                            continue
                        for rel in RELATIONS:
                            cand = NP(d, relation=(rel, a))
                            if _related(rel, objects[m]["box"], objects[j]["box"]) and resolve(cand, meta) == [m]:
                                middles.append((m, cand))
            anchors = middles
        for j, a in anchors:
            for rel in RELATIONS:
                if _related(rel, target["box"], objects[j]["box"]):
                    for d in _descs(target):
                        if ambiguous(d):
                            yield NP(d, relation=(rel, a))
    elif kind == "ordinal":
        for d in _descs(target):
            base = _base(NP(d), objects, w, h)
            if 2 <= len(base) <= len(ORDINALS):
                for side in SIDES:
                    k = _ordered(base, objects, side).index(t) + 1
                    yield NP(d, ordinal=(k, side))
    else:
        raise ValueError(f"unknown textual edit kind {kind!r}; choose one of {TEXT_KINDS}")


def edit_query(meta: dict[str, Any], query: str, level: int, rng: np.random.Generator) -> str | None:
    """A query for the same target as ``query``, of kind ``TEXT_KINDS[level]``, exact on the scene (unique referent,
    every object it relies on visible); None when the scene admits none of that kind.

    ``query`` must name the target already (it is checked); the rng picks among the exact candidates, preferring the
    shortest descriptors (the least given away) in a random order among equals.
    """
    if not 0 <= level <= MAX_LEVEL:
        raise ValueError(f"text level must be in [0, {MAX_LEVEL}], got {level}")
    t = target_index(meta)
    if resolve(parse_query(query), meta) != [t]:
        raise ValueError(f"the query {query!r} does not name the scene's target; edits keep the referent")
    vis = visibility(meta)
    kind = TEXT_KINDS[level]
    cands = list(dict.fromkeys(_candidates(meta, kind, vis)))
    order = rng.permutation(len(cands)) if cands else []
    exact = [cands[k] for k in order if query_problem(meta, cands[k], vis) is None]
    if not exact:
        return None
    n_attrs = [sum(v is not None for v in (c.desc.size, c.desc.colour, c.desc.shape)) for c in exact]
    return format_query(exact[int(np.argmin(n_attrs))])


# --- visual edits -----------------------------------------------------------------------------------------------------


def _free_box(
    rng: np.random.Generator, side: int, boxes: list, w: int, h: int, near: Sequence[int] | None, reach: int, gap: int
) -> list[int] | None:
    lo_x, hi_x, lo_y, hi_y = 2, w - side - 2, 2, h - side - 2
    if near is not None:
        lo_x, hi_x = max(lo_x, near[0] - side - reach), min(hi_x, near[2] + reach)
        lo_y, hi_y = max(lo_y, near[1] - side - reach), min(hi_y, near[3] + reach)
    if hi_x < lo_x or hi_y < lo_y:
        return None
    box = first_free_square(rng, side, boxes, (lo_x, hi_x, lo_y, hi_y), gap, tries=256)
    return None if box is None else list(box)


def _lookalike(rng: np.random.Generator, target: dict[str, Any]) -> dict[str, str]:
    """Shares exactly two of the target's attributes; the third is changed."""
    attr = ATTRS[int(rng.integers(3))]
    values = {"size": SIZES, "colour": OBJECT_COLOURS, "shape": SHAPES}[attr]
    other = [v for v in values if v != target[attr]]
    return {a: (other[int(rng.integers(len(other)))] if a == attr else target[a]) for a in ATTRS}


def _background_colours(rng: np.random.Generator, used: set[str], textured: bool) -> tuple[str, str | None]:
    free = [c for c in COLOURS if c not in used]
    colour = free[int(rng.integers(len(free)))]
    if not textured:
        return colour, None
    rest = [c for c in free if c != colour]
    return colour, rest[int(rng.integers(len(rest)))]


INPAINT_KIND = "inpaint"
"""The data server's edit of a real image (``synth.api.EditStep``): regions repainted after a description."""
CLUTTER_OBJECTS = (
    "a potted plant", "a chair", "a backpack", "an umbrella", "a bottle", "a cup", "a stack of books", "a vase",
    "a wall clock", "a suitcase", "a bench", "a floor lamp", "a bicycle", "a traffic cone", "a cardboard box",
)  # fmt: skip
"""What ``plan_inpaint`` paints into a real image: common objects, one kind per edit, never one the query names."""
MAX_INPAINT_REGIONS = 4


def _words(text: str) -> set[str]:
    """Lower-case words of ``text`` and their singular (a trailing "s" dropped), for the query / object name check."""
    words = {w for w in re.split(r"[^a-z]+", text.lower()) if w}
    return words | {w[:-1] for w in words if len(w) > 3 and w.endswith("s")}


def plan_inpaint(
    query: str,
    boxes: Sequence[Sequence[float]],
    size: tuple[int, int],
    level: int,
    rng: np.random.Generator,
    margin: float = 0.05,
    tries: int = 64,
) -> dict[str, Any] | None:
    """The harder version of a *real* image (no toy scene to re-render, so no exact question edit): an ``inpaint``
    job that paints clutter around the target, ``{"kind": "inpaint", "params": {"description", "regions"}}``.

    ``min(level, MAX_INPAINT_REGIONS)`` regions (input pixels of the ``size = (w, h)`` image), each the target's
    size scaled by 0.6-1.2 (at least a tenth, at most a third of each side), inside the image, clear of every box in
    ``boxes`` by ``margin`` of the image's sides and of each other; fewer when no more fit in ``tries`` draws, None
    when none does or the level is below 1. The description is one of ``CLUTTER_OBJECTS`` that shares no word with
    the query ("a chair" is never painted for "the chair on the left"), so a painted object is not a second answer
    to the question: the label stays the boxes, whose foreground the server keeps and audits (docs/decisions.md,
    "Visual edits of real images"). What the painter draws in a region is not checked: the clutter is a difficulty,
    not a label.
    """
    if level < 1:
        return None
    w, h = int(size[0]), int(size[1])
    named = _words(query)
    names = [d for d in CLUTTER_OBJECTS if not _words(d).difference({"a", "an", "of"}) & named]
    if not names or not boxes:
        return None
    tx1, ty1, tx2, ty2 = (float(v) for v in boxes[0])
    mx, my = margin * w, margin * h
    taken = [(b[0] - mx, b[1] - my, b[2] + mx, b[3] + my) for b in boxes]
    regions: list[list[int]] = []
    for _ in range(tries):
        if len(regions) == min(level, MAX_INPAINT_REGIONS):
            break
        f = float(rng.uniform(0.6, 1.2))
        rw = int(round(min(max((tx2 - tx1) * f, w / 10), w / 3)))
        rh = int(round(min(max((ty2 - ty1) * f, h / 10), h / 3)))
        if rw >= w or rh >= h:
            continue
        x1, y1 = int(rng.integers(0, w - rw + 1)), int(rng.integers(0, h - rh + 1))
        box = (x1, y1, x1 + rw, y1 + rh)
        if any(box_intersection(box, b) > 0 for b in taken):
            continue
        regions.append(list(box))
        taken.append(box)
    if not regions:
        return None
    return {"kind": INPAINT_KIND, "params": {"description": names[int(rng.integers(len(names)))], "regions": regions}}


def plan_visual_edit(
    meta: dict[str, Any], kind: str, level: int, rng: np.random.Generator, tries: int = 8
) -> dict[str, Any] | None:
    """A visual edit job ``{"kind", "params"}`` of intensity ``level`` (>= 1; the sub-problems ignore it) whose
    execution keeps the target's pixels and box and the scene's query exact; None when none is found in ``tries``.

    - ``lookalikes``: ``level`` (at most 4) foreground objects sharing two of the target's attributes, within
      ``0.12 - 0.02 * level`` of the image side of the target (closer as the level grows), 3 px clear of every
      foreground box; params ``{"objects": [{"size", "colour", "shape", "box"}], "render_seed"}`` (the scene's own:
      the painted distractors move only where a look-alike now stands).
    - ``clutter``: a textured background and a painted group that shares one or two of the target's attributes,
      "few" / "some" / "many" at levels 1 / 2 / 3+; params ``{"description", "n_painted", "render_seed"}``.
    - ``occlude``: neutral rectangles over up to ``level`` (at most 4) clear non-target objects (look-alikes first,
      only those the query stays exact without: see ``query_problem``), each covering part of
      the object but leaving every row and column of its shape visible, never within 1 px of the target's box;
      params ``{"occluders": [{"box", "colour"}]}``.
    - ``declutter`` (the visual sub-problem): a plain white background, no painted distractors.
    - ``isolate`` (the easier one): declutter, and of the other foreground objects keep only those the query needs
      to stay exact (each removed in turn, most attributes shared with the target first, if the query stays exact
      without it); params ``{"description", "n_painted": 0, "keep": [their boxes]}``. None when nothing can go.
    - ``zoom`` (the other easier one, ``ZOOM_KIND``): crop to a window of ``1 / ZOOM_FACTOR`` of the image's sides
      that holds the target (centred on it where the image allows, else the nearest window that keeps the query
      exact) and draw it ``ZOOM_FACTOR`` times larger; the objects wholly inside stay, mapped, the others go, and the
      painted distractors scale with the window's area; params ``{"factor", "origin": [x, y], "n_painted"}``. The
      target's box changes (``zoom_box``). None when the target does not fit a window or no window keeps the query
      exact.
    """
    if kind not in VISUAL_KINDS + SUB_VISUAL_KINDS:
        raise ValueError(f"unknown visual edit kind {kind!r}; choose one of {VISUAL_KINDS + SUB_VISUAL_KINDS}")
    if kind not in SUB_VISUAL_KINDS and level < 1:
        raise ValueError(f"a visual edit's level is its intensity and must be >= 1, got {level}")
    query = meta["query"]
    t = target_index(meta)
    for _ in range(1 if kind in SUB_VISUAL_KINDS else tries):  # the sub-problems draw nothing at random
        job = _plan_once(meta, kind, level, rng, t)
        if job is None:
            continue
        _, new_meta = execute_job(meta, job)
        if query_problem(new_meta, query) is None:
            return job
    return None


def _plan_once(meta: dict[str, Any], kind: str, level: int, rng: np.random.Generator, t: int) -> dict | None:
    objects, w, h = _objects(meta), meta["width"], meta["height"]
    target = objects[t]
    fore = _foreground(meta)
    seed = int(rng.integers(2**31))
    if kind == SUB_VISUAL_KIND:
        return {"kind": kind, "params": {"description": str(Description("plain", "white")), "n_painted": 0}}
    if kind == ISOLATE_KIND:
        return _plan_isolate(meta, t)
    if kind == ZOOM_KIND:
        return _plan_zoom(meta, t)
    if kind == "lookalikes":
        boxes = [o["box"] for o in fore]
        added = []
        reach = max(2, int(round((0.12 - 0.02 * min(level, 4)) * min(w, h))))
        for _ in range(min(level, 4)):
            attrs = _lookalike(rng, target)
            lo, hi = SIZE_FRACTIONS[attrs["size"]]
            side = max(3, int(round(rng.uniform(lo, hi) * min(w, h))))
            box = _free_box(rng, side, boxes, w, h, target["box"], reach, gap=3)
            if box is None:
                return None
            boxes.append(box)
            added.append({**attrs, "box": box})
        # the painted distractors keep their seed: they only move where a look-alike now stands
        return {"kind": kind, "params": {"objects": added, "render_seed": meta["render_seed"]}}
    if kind == "clutter":
        keep = sorted(rng.choice(3, size=int(rng.integers(1, 3)), replace=False).tolist())
        group = {
            a: (target[a] if j in keep else [v for v in vals if v != target[a]][int(rng.integers(len(vals) - 1))])
            for j, (a, vals) in enumerate(zip(ATTRS, (SIZES, OBJECT_COLOURS, SHAPES)))
        }
        count = ("few", "some", "many")[min(level, 3) - 1]
        used = {o["colour"] for o in fore} | {group["colour"]}
        texture = grammar.TEXTURED_BACKGROUNDS[int(rng.integers(len(grammar.TEXTURED_BACKGROUNDS)))]
        c1, c2 = _background_colours(rng, used, textured=True)
        d = Description(texture, c1, c2, count, group["shape"], group["colour"], group["size"])
        lo, hi = grammar.COUNT_RANGES[count]
        return {"kind": kind, "params": {"description": str(d), "n_painted": int(rng.integers(lo, hi + 1)),
                                         "render_seed": seed}}  # fmt: skip
    # occlude
    vis = visibility(meta)
    d = grammar.parse_description(meta["description"])
    bg = {d.colour, d.colour2 or grammar._contrast(d.colour)}  # a texture's implicit second colour
    colour = next(c for c in NEUTRALS if c not in bg)
    tb = target["box"]
    shared = [sum(o[a] == target[a] for a in ATTRS) for o in objects]
    np_ = parse_query(meta["query"])
    plain = np_.relation is None and np_.ordinal is None

    def occludable(i: int) -> bool:  # the query stays exact with object i occluded (see query_problem)
        o = objects[i]
        relevant = any(sub.desc.colour in (None, o["colour"]) for sub in _nps(np_))
        return not relevant or (plain and np_.desc.size is not None and o["size"] != np_.desc.size)

    order = [i for i in rng.permutation(len(objects)).tolist() if i != t and vis[i] == "clear" and occludable(i)]
    order.sort(key=lambda i: -shared[i])  # look-alikes first
    occluders: list[dict[str, Any]] = []
    for i in order:
        if len(occluders) == min(level, 4):
            break
        x1, y1, x2, y2 = objects[i]["box"]
        bw, bh = x2 - x1, y2 - y1
        mask = grammar.shape_mask(objects[i]["shape"], bw, bh)
        for fw, fh in [(0.7, 0.3), (0.3, 0.7), (0.5, 0.4), (0.4, 0.5)][int(rng.integers(2)) :]:
            ow, oh = max(1, int(round(fw * bw))), max(1, int(round(fh * bh)))
            ox, oy = x1 + (bw - ow) // 2, y1 + (bh - oh) // 2
            box = [ox, oy, ox + ow, oy + oh]
            if box[0] < tb[2] + 1 and box[2] > tb[0] - 1 and box[1] < tb[3] + 1 and box[3] > tb[1] - 1:
                continue
            shown = mask.copy()
            shown[oy - y1 : oy - y1 + oh, ox - x1 : ox - x1 + ow] = False
            if shown.any(0).all() and shown.any(1).all() and shown.sum() < mask.sum():
                occluders.append({"box": box, "colour": colour})
                break
    if not occluders:
        return None
    return {"kind": "occlude", "params": {"occluders": occluders}}


def _plan_isolate(meta: dict[str, Any], t: int) -> dict | None:
    objects = _objects(meta)
    target, query = objects[t], meta["query"]
    plain = {"description": str(Description("plain", "white")), "n_painted": 0}
    kept = [o for i, o in enumerate(objects) if i != t and o["role"] != "distractor"]
    shared = lambda o: sum(o[a] == target[a] for a in ATTRS)  # noqa: E731
    removed = 0
    for o in sorted(kept, key=lambda o: (-shared(o), o["box"])):  # look-alikes first; deterministic
        trial = [k for k in kept if k is not o]
        job = {"kind": ISOLATE_KIND, "params": {**plain, "keep": [list(k["box"]) for k in trial]}}
        if query_problem(execute_job(meta, job)[1], query) is None:
            kept, removed = trial, removed + 1
    if not removed:
        return None
    return {"kind": ISOLATE_KIND, "params": {**plain, "keep": [list(k["box"]) for k in kept]}}


def _plan_zoom(meta: dict[str, Any], t: int, factor: int = ZOOM_FACTOR) -> dict | None:
    w, h = meta["width"], meta["height"]
    if w % factor or h % factor:
        return None
    cw, ch = _zoom_window(meta, factor)
    x1, y1, x2, y2 = meta["objects"][t]["box"]
    lo_x, hi_x, lo_y, hi_y = max(0, x2 - cw), min(x1, w - cw), max(0, y2 - ch), min(y1, h - ch)
    if hi_x < lo_x or hi_y < lo_y:  # the target is larger than the window
        return None
    cx = int(np.clip(round((x1 + x2 - cw) / 2), lo_x, hi_x))
    cy = int(np.clip(round((y1 + y2 - ch) / 2), lo_y, hi_y))
    xs = sorted({int(round(v)) for v in np.linspace(lo_x, hi_x, 5)} | {cx}, key=lambda v: abs(v - cx))
    ys = sorted({int(round(v)) for v in np.linspace(lo_y, hi_y, 5)} | {cy}, key=lambda v: abs(v - cy))
    painted = sum(o["role"] == "distractor" for o in _objects(meta))
    n_painted = int(round(meta.get("n_painted", painted) / factor**2))
    for ox, oy in sorted(((x, y) for x in xs for y in ys), key=lambda p: abs(p[0] - cx) + abs(p[1] - cy)):
        job = {"kind": ZOOM_KIND, "params": {"factor": factor, "origin": [ox, oy], "n_painted": n_painted}}
        if query_problem(execute_job(meta, job)[1], meta["query"]) is None:
            return job
    return None
