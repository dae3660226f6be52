"""The toy world's query language: referring expressions over a scene's objects, their canonical text, what they
name, whether they are exact, and the chain of sub-problems of a relational one.

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

``decompose`` splits a relational query into its steps (anchor, ..., target), each a valid query with an exact box;
``guided_query`` writes the sub-problem version of a multi-step query (its steps spelled out).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any

from core.toy.grammar import OBJECT_COLOURS, SHAPES, SIZES
from core.toy.scene import Visibility, _objects, target_index, visibility

ATTRS = ("size", "colour", "shape")
SIDES = ("left", "right", "top", "bottom")
RELATIONS = ("left of", "right of", "above", "below")
ORDINALS = ("first", "second", "third", "fourth", "fifth")

MARGIN_FRAC = 0.04
"""Relations, regions and ordinals need this fraction of the image's short side (9 px at 224) of clearance between
what is in and what is out, so that no object sits on a boundary a viewer could read either way."""


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


# --- sub-problems -----------------------------------------------------------------------------------------------------


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
