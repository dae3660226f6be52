"""Instruction evolution on the toy world (EvolvedGRPO's building blocks): textual and visual edits with exact labels,
sub-problems with prefix-style process rewards, and the per-sample difficulty level.

EvolvedGRPO (docs/evolved_grpo.md) keeps GRPO's groups from converging to one reward by editing each question to be
harder once the model solves it, in two modalities, and by stepping a too-hard question back to sub-problems. On the
toy world every edit keeps the label exact because the scene model is known:

- **Textual edits** (``edit_query``): a new referring expression for the *same* target object, unique in the scene
  under the query semantics below, by level: attributes (+ a location), negation, one spatial relation, ordinal
  (counting), two-hop relation. ``None`` when no such query exists at that level: never an ambiguous one.
- **Visual edits** (``plan_visual_edit`` -> a job dict ``{"kind", "params"}`` -> ``execute_job``): closer look-alikes
  of the target, clutter (a textured background with more painted distractors), occlusion of non-target objects, and
  the visual sub-problems "declutter" and, easier, "isolate" (declutter, and every other object the query does not
  need removed). The job holds everything needed to re-render (boxes, description, seeds), so a
  data server can execute it; here ``execute_job`` runs the toy renderer. The target's pixels and box never change.
- **Sub-problems** (``decompose``): a relational query's chain of steps (anchor, ..., target), each a valid REC query
  with an exact box; the model writes one ``<step>[box]</step>`` per step inside ``<think>`` and
  ``prefix_process_reward`` credits the correct prefix (docs/decisions.md, "EvolvedGRPO's edits").
- **Levels** (``LevelState``): per-sample ``(level, sub)``; a group that is all correct goes harder, one that is all
  wrong steps back to the sub-problem version (with ``sub_levels=2`` then to the easier, isolated one), then a level
  down.

Query language (canonical text, parsed by ``parse_query``, printed by ``format_query``)::

    NP     := "the" [ORDINAL] DESC [REGION] [NEG] [REL NP] [FROM]
    DESC   := [small|large] [colour] (circle|square|...|shape)      "shape" matches any object
    REGION := "in the" (left|right|top|bottom) "half"                box entirely inside that half of the image
    NEG    := "that is not" (small|large | colour | "a" shape)       the attribute differs
    REL    := "left of" | "right of" | "above" | "below"             boxes separated along that axis
    FROM   := "from the" (left|right|top|bottom)                     only with ORDINAL (first ... fifth)

Semantics over the scene's objects (``meta["objects"]``: targets, foreground objects and painted distractors;
occluders are not objects): ``o`` is *left of* ``a`` when ``o.x2 <= a.x1`` (its box lies entirely to the left, at
any height), likewise right of / above / below; an anchor NP must name exactly one object; "the k-th D from the
left" sorts the objects matching D by box centre. A query is *exact* on a scene (``query_problem`` returns None) when
it names exactly the target and nothing a viewer needs is unclear: the target and every object the query's
descriptors could match (same colour; any colour for a colourless descriptor) are fully visible and apart from other
objects (an occluded object is allowed only where its size, still visible, rules it out of a plain attribute query),
no other object is within a margin of a relation's or a region's boundary, and ordinal neighbours are a margin apart
and in one order by edges and by centres.
"""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import numpy as np
from PIL import Image

from datamodules import grammar
from datamodules.grammar import COLOURS, OBJECT_COLOURS, SHAPES, SIZE_FRACTIONS, SIZES, Description
from datamodules.toy import difficulty, first_free_square

ATTRS = ("size", "colour", "shape")
SIDES = ("left", "right", "top", "bottom")
RELATIONS = ("left of", "right of", "above", "below")
ORDINALS = ("first", "second", "third", "fourth", "fifth")
NEUTRALS = ("gray", "black", "white")
"""Occluder colours: never an object colour, so an occluder is never a "shape" of the query language."""

MARGIN_FRAC = 0.04
"""Relations, regions and ordinals need this fraction of the image's short side (9 px at 224) of clearance between
what is in and what is out, so that no object sits on a boundary a viewer could read either way."""

TEXT_KINDS = ("original", "attributes", "negation", "relation", "ordinal", "multihop")
"""Textual edit kinds; the index is the level (``TEXT_KINDS[level]``)."""
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
EASIER_KINDS = (ISOLATE_KIND, ZOOM_KIND)
"""What the easier version below a sub-problem (``Level.sub == 2``) can be (``evolve``'s ``easier``)."""
EASIER_LABELS = {ISOLATE_KIND: "isolated", ZOOM_KIND: "zoomed"}
"""How the logs name a sample in each easier version (``LevelState.stats``: ``level/<label>_frac``)."""
MAX_LEVEL = len(TEXT_KINDS) - 1


# --- the query language ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Desc:
    """Attributes an object must have; None = any (all None reads "the shape")."""

    size: str | None = None
    colour: str | None = None
    shape: str | None = None

    def matches(self, o: dict[str, Any]) -> bool:
        return all(getattr(self, a) is None or getattr(self, a) == o[a] for a in ATTRS)

    def words(self) -> list[str]:
        return [w for w in (self.size, self.colour) if w] + [self.shape or "shape"]


@dataclass(frozen=True)
class NP:
    """A referring expression; see the module docstring for its text and semantics."""

    desc: Desc
    region: str | None = None
    """One of SIDES: the box lies entirely in that half of the image."""
    negate: tuple[str, str] | None = None
    """(attribute, value): the object's attribute differs from value."""
    relation: tuple[str, NP] | None = None
    """(one of RELATIONS, anchor NP); the anchor must name exactly one object."""
    ordinal: tuple[int, str] | None = None
    """(k >= 1, side): the k-th object matching the rest, counted from that side by box centre."""

    def hops(self) -> int:
        return 0 if self.relation is None else 1 + self.relation[1].hops()


def format_query(np_: NP) -> str:
    words = ["the"]
    if np_.ordinal:
        words.append(ORDINALS[np_.ordinal[0] - 1])
    words += np_.desc.words()
    if np_.region:
        words += ["in", "the", np_.region, "half"]
    if np_.negate:
        attr, value = np_.negate
        words += ["that", "is", "not"] + (["a", value] if attr == "shape" else [value])
    if np_.relation:
        words += [np_.relation[0], format_query(np_.relation[1])]
    if np_.ordinal:
        words += ["from", "the", np_.ordinal[1]]
    return " ".join(words)


class QueryParseError(ValueError):
    pass


def parse_query(text: str) -> NP:
    """The NP of a canonical query text (``format_query``'s output, also the toy world's "the small red circle");
    raises QueryParseError on anything else."""
    tokens = text.strip().lower().split()
    np_, pos = _parse_np(tokens, 0, text)
    if pos != len(tokens):
        raise QueryParseError(f"unexpected {' '.join(tokens[pos:])!r} at the end of the query {text!r}")
    return np_


def _parse_np(tokens: list[str], pos: int, text: str) -> tuple[NP, int]:
    def peek(k: int = 0) -> str | None:
        return tokens[pos + k] if pos + k < len(tokens) else None

    def expect(word: str) -> None:
        nonlocal pos
        if peek() != word:
            raise QueryParseError(f"expected {word!r} at word {pos} of the query {text!r}, got {peek()!r}")
        pos += 1

    expect("the")
    ordinal = None
    if peek() in ORDINALS:
        ordinal = ORDINALS.index(peek()) + 1
        pos += 1
    size = colour = shape = None
    if peek() in SIZES:
        size, pos = peek(), pos + 1
    if peek() in OBJECT_COLOURS:
        colour, pos = peek(), pos + 1
    if peek() in SHAPES:
        shape, pos = peek(), pos + 1
    elif peek() == "shape":
        pos += 1
    else:
        raise QueryParseError(f"expected a shape word at word {pos} of the query {text!r}, got {peek()!r}")
    region = negate = relation = None
    if peek() == "in":
        expect("in")
        expect("the")
        if peek() not in SIDES:
            raise QueryParseError(f"expected one of {SIDES} after 'in the' in the query {text!r}")
        region, pos = peek(), pos + 1
        expect("half")
    if peek() == "that":
        expect("that")
        expect("is")
        expect("not")
        if peek() == "a":
            pos += 1
            if peek() not in SHAPES:
                raise QueryParseError(f"expected a shape after 'not a' in the query {text!r}")
            negate = ("shape", peek())
        elif peek() in SIZES:
            negate = ("size", peek())
        elif peek() in OBJECT_COLOURS:
            negate = ("colour", peek())
        else:
            raise QueryParseError(f"expected a size, colour or 'a <shape>' after 'not' in the query {text!r}")
        pos += 1
    two = " ".join(tokens[pos : pos + 2])
    if two in ("left of", "right of") or peek() in ("above", "below"):
        rel = two if two in ("left of", "right of") else peek()
        pos += len(rel.split())
        anchor, pos = _parse_np(tokens, pos, text)
        relation = (rel, anchor)
    side = None
    if ordinal is not None:
        expect("from")
        expect("the")
        if peek() not in SIDES:
            raise QueryParseError(f"expected one of {SIDES} after 'from the' in the query {text!r}")
        side, pos = peek(), pos + 1
    return NP(Desc(size, colour, shape), region, negate, relation, (ordinal, side) if ordinal else None), pos


# --- semantics -------------------------------------------------------------------------------------------------------


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


def _related(rel: str, o: Sequence[float], a: Sequence[float]) -> bool:
    if rel == "left of":
        return o[2] <= a[0]
    if rel == "right of":
        return o[0] >= a[2]
    if rel == "above":
        return o[3] <= a[1]
    return o[1] >= a[3]  # below


def _slack(rel: str, o: Sequence[float], a: Sequence[float]) -> float:
    """How far ``o`` is from the boundary of ``rel`` (positive either side): for "left of", |a.x1 - o.x2|."""
    if rel == "left of":
        return abs(a[0] - o[2])
    if rel == "right of":
        return abs(o[0] - a[2])
    if rel == "above":
        return abs(a[1] - o[3])
    return abs(o[1] - a[3])


def _in_region(side: str, box: Sequence[float], w: int, h: int) -> bool:
    x1, y1, x2, y2 = box
    return {"left": x2 <= w / 2, "right": x1 >= w / 2, "top": y2 <= h / 2, "bottom": y1 >= h / 2}[side]


def _out_of_region(side: str, box: Sequence[float], w: int, h: int) -> bool:
    """Entirely in the opposite half (clearly not in ``side``'s half)."""
    opposite = {"left": "right", "right": "left", "top": "bottom", "bottom": "top"}[side]
    return _in_region(opposite, box, w, h)


def _centre(box: Sequence[float], side: str) -> float:
    return (box[0] + box[2]) / 2 if side in ("left", "right") else (box[1] + box[3]) / 2


def _ordered(indices: Iterable[int], objects: list[dict], side: str) -> list[int]:
    key = [(_centre(objects[i]["box"], side), i) for i in indices]
    key.sort(reverse=side in ("right", "bottom"))
    return [i for _, i in key]


def _base(np_: NP, objects: list[dict], w: int, h: int) -> list[int]:
    """Objects matching the descriptor, region and negation of ``np_`` (no relation, no ordinal)."""
    out = []
    for i, o in enumerate(objects):
        if not np_.desc.matches(o):
            continue
        if np_.region and not _in_region(np_.region, o["box"], w, h):
            continue
        if np_.negate and o[np_.negate[0]] == np_.negate[1]:
            continue
        out.append(i)
    return out


def resolve(np_: NP, meta: dict[str, Any]) -> list[int]:
    """Indices into ``meta["objects"]`` of the objects ``np_`` names (exactly one for a valid REC query)."""
    objects, w, h = _objects(meta), meta["width"], meta["height"]
    out = _base(np_, objects, w, h)
    if np_.relation:
        rel, anchor_np = np_.relation
        anchors = resolve(anchor_np, meta)
        if len(anchors) != 1:
            return []
        a = objects[anchors[0]]["box"]
        out = [i for i in out if i != anchors[0] and _related(rel, objects[i]["box"], a)]
    if np_.ordinal:
        k, side = np_.ordinal
        ordered = _ordered(out, objects, side)
        out = [ordered[k - 1]] if len(ordered) >= k else []
    return out


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


# --- exactness -------------------------------------------------------------------------------------------------------


def _margin(meta: dict[str, Any]) -> float:
    return MARGIN_FRAC * min(meta["width"], meta["height"])


def _nps(np_: NP) -> Iterator[NP]:
    yield np_
    if np_.relation:
        yield from _nps(np_.relation[1])


def query_problem(
    meta: dict[str, Any], np_: NP | str, vis: Sequence[Visibility] | None = None, referent: int | None = None
) -> str | None:
    """Why ``np_`` is not an exact REC query for the scene's target (None when it is); see the module docstring.
    ``referent``: check it against another object instead (a sub-problem step names an anchor)."""
    if isinstance(np_, str):
        try:
            np_ = parse_query(np_)
        except QueryParseError as err:
            return f"unparsable: {err}"
    objects, w, h = _objects(meta), meta["width"], meta["height"]
    t = target_index(meta) if referent is None else referent
    got = resolve(np_, meta)
    if got != [t]:
        return f"names objects {got}, not the referent {t}"
    vis = visibility(meta) if vis is None else vis
    if vis[t] != "clear":
        return "the referent is not clear"
    plain = np_.relation is None and np_.ordinal is None
    top_size = np_.desc.size
    margin = _margin(meta)
    for sub in _nps(np_):
        for i, o in enumerate(objects):
            relevant = sub.desc.colour is None or sub.desc.colour == o["colour"]
            if not relevant or vis[i] == "clear":
                continue
            # an occluded object is fine where its visible size already rules it out of a plain query
            if not (vis[i] == "occluded" and plain and top_size is not None and o["size"] != top_size):
                return f"object {i} ({o['size']} {o['colour']} {o['shape']}) is {vis[i]}"
        base = _base(replace(sub, region=None), objects, w, h)
        if sub.region:
            for i in base:
                inside = _in_region(sub.region, objects[i]["box"], w, h)
                if not inside and not _out_of_region(sub.region, objects[i]["box"], w, h):
                    return f"object {i} straddles the {sub.region} half"
        if sub.relation:
            rel, anchor_np = sub.relation
            anchors = resolve(anchor_np, meta)
            if len(anchors) != 1:
                return f"the anchor {format_query(anchor_np)!r} names {len(anchors)} objects"
            a = objects[anchors[0]]["box"]
            for i in _base(sub, objects, w, h):
                b = objects[i]["box"]
                if i != anchors[0] and not _related(rel, b, a) and _slack(rel, b, a) < margin:
                    return f"object {i} is within {margin:.0f} px of being {rel} the anchor"
        if sub.ordinal:
            k, side = sub.ordinal
            cand = _base(sub, objects, w, h)
            if sub.relation:
                cand = [i for i in cand if i in resolve(replace(sub, ordinal=None), meta)]
            centres = sorted(_centre(objects[i]["box"], side) for i in cand)
            if any(b - a < margin for a, b in zip(centres, centres[1:])):
                return f"two objects counted from the {side} are closer than {margin:.0f} px"
            lo, hi = (0, 2) if side in ("left", "right") else (1, 3)
            by_near = sorted(cand, key=lambda i: objects[i]["box"][lo])
            by_far = sorted(cand, key=lambda i: objects[i]["box"][hi])
            if by_near != by_far or by_near != _ordered(cand, objects, "left" if lo == 0 else "top"):
                return f"counted from the {side}, the objects' order by edges differs from their order by centres"
    return None


def is_exact(meta: dict[str, Any], np_: NP | str) -> bool:
    return query_problem(meta, np_) is None


# --- textual edits ---------------------------------------------------------------------------------------------------


def _descs(o: dict[str, Any], min_attrs: int = 0) -> list[Desc]:
    """Every descriptor true of ``o`` (subsets of its attributes), fewest attributes first."""
    out = []
    for mask in range(8):
        keep = [bool(mask & (1 << j)) for j in range(3)]
        if sum(keep) >= min_attrs:
            out.append(Desc(*(o[a] if k else None for a, k in zip(ATTRS, keep))))
    return sorted(out, key=lambda d: sum(v is not None for v in (d.size, d.colour, d.shape)))


def minimal_np(meta: dict[str, Any], i: int, vis: Sequence[Visibility] | None = None) -> NP | None:
    """The shortest plain attribute NP naming object ``i`` alone, with every object it could match clear; None if
    even the full triple is not unique."""
    objects = _objects(meta)
    vis = visibility(meta) if vis is None else vis
    if vis[i] != "clear":
        return None
    for d in _descs(objects[i]):
        np_ = NP(d)
        if _base(np_, objects, meta["width"], meta["height"]) == [i] and all(
            vis[j] == "clear" for j, o in enumerate(objects) if d.colour is None or d.colour == o["colour"]
        ):
            return np_
    return None


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


# --- rendering and visual edits --------------------------------------------------------------------------------------


def _foreground(meta: dict[str, Any]) -> list[dict[str, Any]]:
    return [o for o in _objects(meta) if o["role"] != "distractor"]


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
    from core.regions.boxes import box_intersection

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


# --- sub-problems and the prefix-style process reward ----------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One sub-problem: a valid REC query and the exact box of the object it names (original pixels)."""

    query: str
    box: list[int]


def decompose(meta: dict[str, Any], query: str) -> list[Step]:
    """The steps of a relational query, innermost anchor first and the query itself last: "the circle below the shape
    left of the red square" -> the red square; the shape left of the red square; the circle below ... . Each step is
    a query whose referent is unique (the anchors of an exact query are). A query without relations is one step."""
    np_ = parse_query(query)
    chain = list(_nps(np_))[::-1]
    steps = []
    for sub in chain:
        got = resolve(sub, meta)
        if len(got) != 1:
            raise ValueError(f"the step {format_query(sub)!r} of {query!r} names {len(got)} objects, not one")
        steps.append(Step(format_query(sub), list(meta["objects"][got[0]]["box"])))
    return steps


def guided_query(steps: Sequence[Step]) -> str:
    """The sub-problem version of a multi-step query: the query with its steps spelled out, in order."""
    if len(steps) < 2:
        return steps[-1].query
    plan = "; ".join(f"step {k}: {s.query}" for k, s in enumerate(steps[:-1], 1))
    return f"{steps[-1].query} ({plan}; then the answer)"


GUIDE_MARK = " (step 1: "
"""Where ``guided_query`` appends the spelled-out steps to the query."""


def query_steps(meta: dict[str, Any], query: str) -> list[Step]:
    """The steps of a sample's question on its scene (``decompose``; a guided sub-problem question counts as its
    query); [] when the sample is no toy REC scene or the question is no query of the language."""
    if not meta.get("objects"):
        return []
    try:
        return decompose(meta, query.split(GUIDE_MARK, 1)[0])
    except ValueError:  # QueryParseError included; an OVD scene; a step that no longer names one object
        return []


def is_sub_problem(meta: dict[str, Any], query: str) -> bool:
    """Whether a sample is in a sub-problem version: its steps spelled out, or its image decluttered or isolated."""
    edits = meta.get("edits") or []
    return GUIDE_MARK in query or bool(edits and edits[-1].get("kind") in SUB_VISUAL_KINDS)


def version_depth(meta: dict[str, Any], query: str) -> int:
    """How far a sample's version is eased below its question (``Level.sub``, read from the sample itself): 0 the
    question, 1 the sub-problem version, 2 the easier one (its last edit ``isolate`` or ``zoom``)."""
    if not is_sub_problem(meta, query):
        return 0
    edits = meta.get("edits") or []
    return 2 if edits and edits[-1].get("kind") in EASIER_KINDS else 1


def format_steps(
    steps: Sequence[Step],
    input_wh: tuple[int, int],
    orig_wh: tuple[int, int],
    queries: bool = True,
    relative: bool = False,
) -> str:
    """The reasoning of a sub-problem completion, to go inside ``<think>``: one sentence per step with its box in a
    ``<step>`` tag, in integer pixels of the model input (as ``toy.sft_target`` writes answers), e.g.
    ``Step 1: the red square <step>[60, 20, 110, 70]</step>. Step 2: the circle below the red square <step>[...]</step>.``;
    ``relative=True`` names a step's predecessor "it" (``Step 2: the circle below it <step>[...]</step>.``: each step
    says what to look for next and stays short, the toy model's named form); ``queries=False`` leaves the steps'
    queries out (``Step 1: <step>[60, 20, 110, 70]</step>.``: the short form, docs/decisions.md)."""
    sx, sy = input_wh[0] / orig_wh[0], input_wh[1] / orig_wh[1]
    parts = []
    for k, s in enumerate(steps, 1):
        x1, y1, x2, y2 = s.box
        box = [int(np.floor(v * f + 0.5)) for v, f in ((x1, sx), (y1, sy), (x2, sx), (y2, sy))]
        query = s.query
        if relative and k > 1 and query.endswith(" " + steps[k - 2].query):
            query = query[: -len(steps[k - 2].query)] + "it"
        parts.append(
            f"Step {k}: {query} <step>{json.dumps(box)}</step>."
            if queries
            else f"Step {k}: <step>{json.dumps(box)}</step>."
        )
    return " ".join(parts)


_STEP_RE = re.compile(r"<step>(.*?)</step>", re.DOTALL)


def parse_steps(text: str, answer_tag: str = "answer") -> list[list[float] | None]:
    """The boxes of the ``<step>...</step>`` parts written before the first ``<answer>``, in order; a step whose
    content holds no box is None (it breaks the prefix). Never raises."""
    from core.boxes import extract_boxes

    if not isinstance(text, str):
        return []
    cut = text.find(f"<{answer_tag}>")
    head = text if cut < 0 else text[:cut]
    out: list[list[float] | None] = []
    for content in _STEP_RE.findall(head):
        boxes = extract_boxes(content)
        out.append(boxes[0] if boxes else None)
    return out


def prefix_credit(pred: Sequence[Sequence[float] | None], gold: Sequence[Sequence[float]], thr: float = 0.5) -> float:
    """Fraction of ``gold`` steps in the longest correct prefix: step k counts only if steps 1..k all reach IoU >=
    ``thr`` with their gold boxes, in order. 0 for no gold steps."""
    from core.boxes import iou

    if not gold:
        return 0.0
    k = 0
    for p, g in zip(pred, gold):
        if p is None or iou(p, g) < thr:
            break
        k += 1
    return k / len(gold)


def prefix_process_reward(
    completions: list[str],
    step_boxes: Sequence[Sequence[Sequence[float]]],
    input_wh: Any = None,
    orig_wh: Any = None,
    iou_threshold: float = 0.5,
    **kwargs: Any,
) -> list[float]:
    """Prefix-style process reward in [0, 1] per completion: ``prefix_credit`` of its ``<step>`` boxes (rescaled from
    the model input ``input_wh`` to original pixels ``orig_wh`` like ``rec_accuracy_reward``) against the gold
    steps. ``step_boxes``: one list of gold boxes per completion (one list for all is broadcast)."""
    n = len(completions)
    if len(step_boxes) and all(isinstance(v, (int, float)) for v in step_boxes[0]):
        step_boxes = [step_boxes] * n  # one gold chain for every completion
    if len(step_boxes) != n:
        raise ValueError(f"step_boxes has {len(step_boxes)} chains for {n} completions")

    def per(value: Any) -> list[Any]:
        if value is None or (len(value) == 2 and all(isinstance(v, (int, float)) for v in value)):
            return [value] * n
        return list(value)

    return [
        prefix_credit(written_steps(text, iw, ow), gold, iou_threshold)
        for text, gold, iw, ow in zip(completions, step_boxes, per(input_wh), per(orig_wh))
    ]


def written_steps(text: str, input_wh: Any = None, orig_wh: Any = None) -> list[list[float] | None]:
    """``parse_steps`` of a completion, its boxes rescaled from the model input ``input_wh`` to original pixels
    ``orig_wh`` (as ``rec_accuracy_reward`` does; unscaled when either is None)."""
    from core.boxes import rescale_box

    pred = parse_steps(text)
    if input_wh is None or orig_wh is None:
        return pred
    return [None if p is None else rescale_box(p, input_wh, orig_wh) for p in pred]


def combine_rewards(outcome: Sequence[float], process: Sequence[float], process_weight: float) -> list[float]:
    """Outcome reward + ``process_weight`` x process reward, per completion; GRPO normalises the sum within each
    group, so the process term only moves advantages where the outcomes tie. ``process_weight = 0`` is plain GRPO."""
    if process_weight < 0:
        raise ValueError(f"--model.process_weight must be >= 0, got {process_weight}")
    if len(outcome) != len(process):
        raise ValueError(f"{len(outcome)} outcome rewards for {len(process)} process rewards")
    return [float(o) + process_weight * float(p) for o, p in zip(outcome, process)]


# --- levels and the adversarial, progressive schedule ----------------------------------------------------------------


@dataclass(frozen=True)
class Level:
    """Where a sample stands: its difficulty level (0 = the original question) and how far it is eased below it:
    ``sub`` 0 is the full question, 1 its sub-problem version (steps spelled out + process reward, or the decluttered
    image), 2 the easier one of ``LevelState(sub_levels=2)`` (the same, on the isolated image: ``isolate``)."""

    level: int = 0
    sub: int = 0


def next_level(state: Level, correct: Sequence[bool], max_level: int = MAX_LEVEL, sub_levels: int = 1) -> Level:
    """The adversarial, progressive rule for one group of G answers to a sample.

    - all G correct (the group converged at full reward, no gradient): a sub-problem version goes one step back up
      towards the full question at its level (sub 2 -> 1 -> 0); the full question goes one level harder (at most
      ``max_level``);
    - all G wrong (converged at zero): the full question steps back to its sub-problem version, and that (with
      ``sub_levels=2``) to the easier one; the easiest version steps one level down (at least 0) to the full
      question there (``sub_levels=0``: no eased version, the full question is the easiest: a real image);
    - otherwise (the group's rewards differ: GRPO learns from it): stay.
    """
    if not len(correct):
        raise ValueError("next_level needs the group's answers; got an empty group")
    sub = int(state.sub)
    if all(correct):
        return Level(state.level, sub - 1) if sub else Level(min(state.level + 1, max_level), 0)
    if not any(correct):
        return Level(state.level, sub + 1) if sub < sub_levels else Level(max(state.level - 1, 0), 0)
    return state


@dataclass
class LevelState:
    """Per-sample levels (sample id -> ``Level``), updated from each group's correctness, checkpointed with the run.

    ``up_after`` / ``back_after``: how many consecutive converged groups of a sample (all answers correct / all wrong)
    move it (`next_level`); a group whose answers differ resets the count. 1 / 1 moves at once, in both directions.
    A larger ``back_after`` keeps a sample on its harder version through a failed group or two before it steps back,
    so the ratio of harder edits to steps back is a setting (the binary-reward study, docs/evolved_grpo.md, found the
    steps back re-creating the ties the harder edits remove). ``sub_levels``: how many eased versions lie below a
    level's full question (1: the sub-problem version; 2: also the isolated one, `next_level`)."""

    max_level: int = MAX_LEVEL
    levels: dict[str, Level] = field(default_factory=dict)
    up_after: int = 1
    back_after: int = 1
    sub_levels: int = 1
    easier: str = ISOLATE_KIND
    """What the version at ``sub`` 2 is (``EASIER_KINDS``): it names the logged fraction (``level/isolated_frac``,
    ``level/zoomed_frac``)."""
    streaks: dict[str, int] = field(default_factory=dict)
    """Sample id -> consecutive all-correct groups (> 0) or all-wrong groups (< 0) since its last move."""

    def __post_init__(self) -> None:
        if not 0 <= self.max_level <= MAX_LEVEL:
            raise ValueError(f"--max_level must be in [0, {MAX_LEVEL}], got {self.max_level}")
        for name in ("up_after", "back_after"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"--callbacks.synthesis.init_args.strategy_args.step_{name} must be an integer >= 1 (converged "
                    f"groups of a sample before it moves), got {value!r}"
                )
        if self.sub_levels not in (1, 2):
            raise ValueError(
                "--callbacks.synthesis.init_args.strategy_args.sub_levels must be 1 (the sub-problem version) or 2 "
                f"(also the isolated image below it), got {self.sub_levels!r}"
            )
        if self.easier not in EASIER_KINDS:
            raise ValueError(
                f"--callbacks.synthesis.init_args.strategy_args.easier must be one of {EASIER_KINDS}, got {self.easier!r}"
            )

    def get(self, sample_id: str) -> Level:
        return self.levels.get(sample_id, Level())

    def update(self, sample_id: str, correct: Sequence[bool], sub_levels: int | None = None) -> Level:
        """Record one group of ``sample_id``'s answers and return its level after it. ``sub_levels`` overrides the
        state's for this sample: 0 for a sample with no eased version (a real image), whose failures step a level
        down."""
        state = self.get(sample_id)
        if not len(correct):
            raise ValueError("next_level needs the group's answers; got an empty group")
        outcome = 1 if all(correct) else -1 if not any(correct) else 0
        streak = self.streaks.get(sample_id, 0)
        streak = 0 if outcome == 0 else streak + outcome if streak * outcome > 0 else outcome
        if streak >= self.up_after or -streak >= self.back_after:
            subs = self.sub_levels if sub_levels is None else sub_levels
            state, streak = next_level(state, correct, self.max_level, subs), 0
        self.levels[sample_id] = state
        if streak:
            self.streaks[sample_id] = streak
        else:
            self.streaks.pop(sample_id, None)
        return state

    def stats(self) -> dict[str, float]:
        """For logging: mean level, fraction of samples in a sub-problem version, and the highest level (with
        ``sub_levels=2`` also the fraction in the isolated version)."""
        extra = (f"level/{EASIER_LABELS[self.easier]}_frac",) if self.sub_levels > 1 else ()
        if not self.levels:
            return {"level/mean": 0.0, "level/sub_frac": 0.0, "level/max": 0.0, **dict.fromkeys(extra, 0.0)}
        vals = list(self.levels.values())
        out = {
            "level/mean": float(np.mean([v.level for v in vals])),
            "level/sub_frac": float(np.mean([v.sub > 0 for v in vals])),
            "level/max": float(max(v.level for v in vals)),
        }
        if extra:
            out[extra[0]] = float(np.mean([v.sub >= 2 for v in vals]))
        return out

    def state_dict(self) -> dict[str, Any]:
        return {
            "max_level": self.max_level,
            "levels": {k: [v.level, int(v.sub)] for k, v in self.levels.items()},
            "streaks": dict(self.streaks),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("max_level", self.max_level) != self.max_level:
            raise ValueError(
                f"checkpoint was saved with max_level={state['max_level']}, this run has {self.max_level}; "
                "resume with the same --max_level"
            )
        self.levels = {k: Level(int(v[0]), int(v[1])) for k, v in state["levels"].items()}  # older: bool sub
        self.streaks = {k: int(v) for k, v in state.get("streaks", {}).items()}  # absent in older checkpoints: none


# --- one evolved sample ----------------------------------------------------------------------------------------------


@dataclass
class Evolved:
    """An evolved version of a toy REC sample: image, query, exact box, and how it was made."""

    image: Image.Image
    query: str
    box: list[int]
    meta: dict[str, Any]
    kind: str
    level: Level
    steps: list[Step] = field(default_factory=list)
    """Sub-problem steps (anchor first, target last); one step for a single-step query."""
    jobs: list[dict[str, Any]] = field(default_factory=list)
    """The visual edit jobs that made the image from the record's, in order (empty: the image is the record's)."""


def evolve(
    record: dict[str, Any],
    level: Level,
    rng: np.random.Generator,
    modality: Literal["any", "text", "visual"] = "any",
    easier: Literal["isolate", "zoom"] = ISOLATE_KIND,
) -> Evolved | None:
    """The version of a toy REC scene record (``toy.make_scene``'s output) at ``level``; None when none exists.

    Level 0 is the record itself. At level L >= 1 the text edit is ``TEXT_KINDS[L]`` and the visual edit one of
    ``VISUAL_KINDS`` at intensity L (``modality="any"``: tried in a random order, the other modality as fall-back).
    The sub-problem version of a multi-step query spells its steps out (``guided_query``); that of a one-step query
    is the decluttered image (``declutter``). The easier version (``level.sub == 2``) is the same on the isolated
    image (``isolate``): the guided query with only the objects it needs, or the one-step query alone with its
    target (when nothing can be removed, the sub-problem version stands in). With ``easier="zoom"`` the easier
    version is the sub-problem version zoomed around the target (``ZOOM_KIND``; its steps spelled out on the zoomed
    scene if it has several): the returned box is the target's mapped box.
    """
    if not 0 <= level.level <= MAX_LEVEL:
        raise ValueError(f"level must be in [0, {MAX_LEVEL}], got {level.level}")
    if easier not in EASIER_KINDS:
        raise ValueError(f"the easier version is one of {EASIER_KINDS}, got {easier!r}")
    meta, image = record["meta"], record["image"]
    query, box = meta["query"], list(meta["objects"][target_index(meta)]["box"])
    if level.level == 0 and not level.sub:
        return Evolved(image, query, box, meta, "original", level, decompose(meta, query))
    options: list[tuple[str, str]] = []
    if level.level >= 1:
        text = [("text", TEXT_KINDS[level.level])]
        visual = [("visual", VISUAL_KINDS[i]) for i in rng.permutation(len(VISUAL_KINDS))]
        if modality == "text":
            options = text
        elif modality == "visual":
            options = visual
        else:
            options = text + visual if rng.random() < 0.5 else visual + text
    else:
        options = [("text", "original")]
    for mod, kind in options:
        if mod == "text":
            new_query = edit_query(meta, query, level.level, rng) if level.level >= 1 else query
            if new_query is None:
                continue
            new_meta, new_image = dict(meta, query=new_query), image
        else:
            job = plan_visual_edit(meta, kind, level.level, rng)
            if job is None:
                continue
            new_image, new_meta = execute_job(meta, job)
            new_query = query
        steps = decompose(new_meta, new_query)
        if level.sub >= 2 and easier == ZOOM_KIND:
            zoomed = _zoomed_version(new_meta, new_query, kind, level, steps, rng)
            if zoomed is not None:
                return zoomed
        iso_job = (
            plan_visual_edit(new_meta, ISOLATE_KIND, 1, rng) if level.sub >= 2 and easier == ISOLATE_KIND else None
        )
        if iso_job is not None:  # the easier version: the isolated image, its steps spelled out if it has several
            iso_image, iso_meta = execute_job(new_meta, iso_job)
            iso_steps = decompose(iso_meta, new_query)
            multi = len(iso_steps) >= 2
            iso_query, iso_kind = (
                (guided_query(iso_steps), f"{kind}+steps+isolate") if multi else (new_query, f"{kind}+isolate")
            )
            return Evolved(iso_image, iso_query, box, iso_meta, iso_kind, level, iso_steps, iso_meta["edits"])
        if level.sub:
            if len(steps) >= 2:
                jobs = new_meta.get("edits", [])
                return Evolved(new_image, guided_query(steps), box, new_meta, f"{kind}+steps", level, steps, jobs)
            sub_job = plan_visual_edit(new_meta, SUB_VISUAL_KIND, 1, rng)
            if sub_job is None:
                continue
            sub_image, sub_meta = execute_job(new_meta, sub_job)
            return Evolved(sub_image, new_query, box, sub_meta, f"{kind}+declutter", level, steps, sub_meta["edits"])
        return Evolved(new_image, new_query, box, new_meta, kind, level, steps, new_meta.get("edits", []))
    return None


def _zoomed_version(
    meta: dict[str, Any], query: str, kind: str, level: Level, steps: list[Step], rng: np.random.Generator
) -> Evolved | None:
    """The sub-problem version of (``meta``, ``query``) zoomed around the target: one-step queries on the decluttered
    image, multi-step ones with their steps spelled out on the zoomed scene; None when no window keeps it exact."""
    base, name = meta, f"{kind}+steps"
    if len(steps) < 2:
        sub_job = plan_visual_edit(meta, SUB_VISUAL_KIND, 1, rng)
        if sub_job is None:
            return None
        base, name = execute_job(meta, sub_job)[1], f"{kind}+declutter"
    zoom_job = plan_visual_edit(base, ZOOM_KIND, 1, rng)
    if zoom_job is None:
        return None
    image, zoomed = execute_job(base, zoom_job)
    z_steps = decompose(zoomed, query)
    z_query = guided_query(z_steps) if len(z_steps) >= 2 else query
    box = list(zoomed["objects"][target_index(zoomed)]["box"])
    return Evolved(image, z_query, box, zoomed, f"{name}+zoom", level, z_steps, zoomed["edits"])


def job_json(job: dict[str, Any]) -> str:
    """A job as the JSON a data server would receive (sorted keys: the same job is the same bytes)."""
    return json.dumps(job, sort_keys=True)


__all__ = [
    "Desc",
    "Evolved",
    "Level",
    "LevelState",
    "EASIER_KINDS",
    "ISOLATE_KIND",
    "MAX_LEVEL",
    "NP",
    "Step",
    "SUB_VISUAL_KINDS",
    "TEXT_KINDS",
    "VISUAL_KINDS",
    "combine_rewards",
    "decompose",
    "edit_query",
    "evolve",
    "format_steps",
    "execute_job",
    "foreground_mask",
    "is_sub_problem",
    "query_steps",
    "format_query",
    "guided_query",
    "is_exact",
    "minimal_np",
    "next_level",
    "parse_query",
    "parse_steps",
    "plan_visual_edit",
    "prefix_credit",
    "prefix_process_reward",
    "query_problem",
    "render_meta",
    "resolve",
    "version_depth",
    "visibility",
    "ZOOM_FACTOR",
    "ZOOM_KIND",
    "zoom_array",
    "zoom_box",
]
