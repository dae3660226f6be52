"""The toy REC / OVD world: procedural scenes with exact boxes, built on the description grammar.

A scene is *foreground objects* (the target and, in most scenes, a few other objects drawn with
``grammar.draw_shape``) plus a ``grammar.Description`` (a background and one group of distractors) rendered around
them with ``grammar.render``. The data server can therefore repaint any toy sample from a new description while the
target, whose box is the label, stays bit-identical, exactly like the paper's outpainting keeps the foreground.

Splits (a RefCOCO vs LISA stand-in):

- ``train`` / ``val``: plain or gradient backgrounds, 1-3 other objects of random attributes;
- ``ood``: striped / checkered / noisy / dotted backgrounds, 4-8 other objects that each share one or two of the
  target's attributes, the foreground ones placed close to the target.
- ``test_id``, ``test_ood_texture``, ``test_ood_crowded``, ``test_ood``: held-out test splits on seeds of their own
  (in-domain; textured backgrounds only; crowded look-alikes only; both), for the study's evaluator;
  ``test_multihop``: in-domain scenes asked with relational and two-hop questions (EvolvedGRPO's hard split).

REC: the query "the small red circle" names the target's (size, colour, shape) triple, unique in the scene.
OVD: the query "every red shape" names a colour; the solution is the boxes of all objects of that colour, and only
foreground objects carry it, so a repaint never removes a labelled object.

Every record is seeded by (seed, split, task, index): the same arguments give the same bytes, and a split of n
records is a prefix of a split of n + k.

CLI: ``python -m datamodules.toy --out data/toy --splits train:512 val:128 ood:128 --seed 0 [--task ovd]``.
"""

from __future__ import annotations

import argparse
import json
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
from PIL import Image

from core.records import Sample
from core.toy import grammar
from core.toy.grammar import OBJECT_COLOURS, SHAPES, SIZE_FRACTIONS, SIZES, Description
from core.toy.indoor import indoor_scene
from core.toy.query import ATTRS, NP, Desc, _descs, decompose, format_query, parse_query, resolve
from core.toy.scene import difficulty, first_free_square, guard_description, target_index
from datamodules.edit_plans import edit_query
from datamodules.evolve import Level, evolve
from datamodules.toy_export import atomic_write, claim, export_rows

TOY_VERSION = 1
"""Bump when the generator's output changes, so exported splits with a stale manifest are regenerated."""


TASKS = ("rec", "ovd", "isr")
"""``isr``: the toy ISR rooms (``core.toy.indoor``): OVD samples, a furniture category and all its boxes."""


@dataclass(frozen=True)
class SplitSpec:
    """How one split's scenes are drawn."""

    code: int
    """Enters the seed, so splits never share scenes."""
    backgrounds: tuple[str, ...]
    """Background textures to draw from."""
    others: tuple[int, int]
    """Inclusive range of non-target objects (foreground objects + painted distractors)."""
    share: bool
    """Other objects share one or two of the target's attributes (else their attributes are random)."""
    near: bool
    """Foreground objects are placed close to the target."""
    text_levels: tuple[int, ...] = ()
    """REC only: the query is rewritten by EvolvedGRPO's textual edit (``edit_plans.edit_query``) at one of these
    levels, ``text_levels[index % len]``, so every level holds the same share of the split; a scene that admits no
    exact query at its level is drawn again (a new seed for the same index). Empty: the plain attribute query."""
    no_target: float = 0.0
    """REC only: this share of the split's queries (drawn per index) has no target (GRES-style): the scene is drawn as
    usual, then the query names the target with its colour or shape changed to a pair no object in it wears (a near
    miss, ``_no_target_query``); ``solution`` is ``[]``."""
    ask_anchor: bool = False
    """With ``text_levels``: ask the multi-step question's first step, its anchor ("the yellow shape" of "the shape left
    of the yellow shape"), as a one-step question on the same scene: the anchor becomes the target, the question is
    kept in ``meta["question"]`` (``_ask_anchor``)."""
    same_size: bool = False
    """REC only: every other object (foreground and painted) has the target's size: its size word tells nothing."""
    short_query: bool = False
    """REC only: the query is the target's shortest exact descriptor ("the yellow shape", "the large shape", "the
    star"; ``_short_query``), the form a multi-step question's anchors take, instead of the full attribute triple."""
    single_attr: bool = False
    """REC only: the query names one attribute that no other object of the scene wears ("the red shape", "the large
    shape", "the circle"; ``_single_attr_query``); a scene whose target has none is drawn again (a new seed for the
    same index). The toy base's SFT task (docs/toy_model.md): grounding by one attribute, never the triple RL asks."""


SPLITS: dict[str, SplitSpec] = {
    "train": SplitSpec(0, grammar.PLAIN_BACKGROUNDS, (1, 3), share=False, near=False),
    "val": SplitSpec(1, grammar.PLAIN_BACKGROUNDS, (1, 3), share=False, near=False),
    "ood": SplitSpec(2, grammar.TEXTURED_BACKGROUNDS, (4, 8), share=True, near=True),
    "solo": SplitSpec(3, grammar.PLAIN_BACKGROUNDS, (0, 0), share=False, near=False),
    "varied": SplitSpec(4, grammar.BACKGROUNDS, (1, 10), share=False, near=False),
    "crowded": SplitSpec(10, grammar.PLAIN_BACKGROUNDS, (4, 8), share=True, near=True),
    "bind": SplitSpec(17, grammar.PLAIN_BACKGROUNDS, (1, 3), share=False, near=False, same_size=True),
    "val_bind": SplitSpec(18, grammar.PLAIN_BACKGROUNDS, (1, 3), share=False, near=False, same_size=True),
    # held-out test splits (docs/study.md): new split codes, so seeds no train / val / ood scene ever used
    "test_id": SplitSpec(5, grammar.PLAIN_BACKGROUNDS, (1, 3), share=False, near=False),
    "test_ood_texture": SplitSpec(6, grammar.TEXTURED_BACKGROUNDS, (1, 3), share=False, near=False),
    "test_ood_crowded": SplitSpec(7, grammar.PLAIN_BACKGROUNDS, (4, 8), share=True, near=True),
    "test_ood": SplitSpec(8, grammar.TEXTURED_BACKGROUNDS, (4, 8), share=True, near=True),
    "test_multihop": SplitSpec(9, grammar.PLAIN_BACKGROUNDS, (1, 3), share=False, near=False, text_levels=(3, 5)),
    # no-target queries (CycleGRPO's GRES-style samples): drawn as train / val, a quarter of the queries name nothing
    "train_nt": SplitSpec(11, grammar.PLAIN_BACKGROUNDS, (1, 3), share=False, near=False, no_target=0.25),
    "val_nt": SplitSpec(12, grammar.PLAIN_BACKGROUNDS, (1, 3), share=False, near=False, no_target=0.25),
    "test_nt": SplitSpec(16, grammar.PLAIN_BACKGROUNDS, (1, 3), share=False, near=False, no_target=0.25),  # held out
    # EvolvedGRPO's too-hard pool: drawn as test_multihop (multi-step questions) on a code of its own, for training
    "train_multihop": SplitSpec(13, grammar.PLAIN_BACKGROUNDS, (1, 3), share=False, near=False, text_levels=(3, 5)),
    # the toy base's SFT scenes (docs/toy_model.md): asked by one unique attribute, on codes no RL split uses
    "base": SplitSpec(19, grammar.PLAIN_BACKGROUNDS, (1, 3), share=False, near=False, single_attr=True),
    "base_varied": SplitSpec(20, grammar.BACKGROUNDS, (1, 10), share=False, near=False, single_attr=True),
    "base_solo": SplitSpec(22, grammar.PLAIN_BACKGROUNDS, (0, 0), share=False, near=False, single_attr=True),
    "val_base": SplitSpec(21, grammar.PLAIN_BACKGROUNDS, (1, 3), share=False, near=False, single_attr=True),
    # the anchors' query form as one-step questions: drawn as train / test_id, asked by the shortest exact descriptor
    "train_short": SplitSpec(14, grammar.PLAIN_BACKGROUNDS, (1, 3), share=False, near=False, short_query=True),
    "test_short": SplitSpec(15, grammar.PLAIN_BACKGROUNDS, (1, 3), share=False, near=False, short_query=True),
    # test_multihop's scenes (its code), each asked its question's first step alone: how well the anchor is grounded
    "test_multihop_anchor": SplitSpec(
        9, grammar.PLAIN_BACKGROUNDS, (1, 3), share=False, near=False, text_levels=(3, 5), ask_anchor=True
    ),
    # train_multihop's scenes asked their first step alone: the chains' anchors as one-step questions, for SFT mixes
    "train_multihop_anchor": SplitSpec(
        13, grammar.PLAIN_BACKGROUNDS, (1, 3), share=False, near=False, text_levels=(3, 5), ask_anchor=True
    ),
}
"""Four splits for ``ToySceneDataset(mix=...)`` only (never validated on). ``solo``: the target alone (where things are
before which thing is meant). ``varied``: any background of the grammar and up to "many" distractors, the kind of image
the procedural painter makes from the model's descriptions, so the warm-started model has seen what the self-evolving
loop feeds it (OOD still differs: its distractors share the target's attributes and crowd it). ``crowded``: 4-8
look-alikes close to the target on plain backgrounds, drawn as ``test_ood_crowded`` on a code of its own, for RL runs
where a caption must single out its object among look-alikes (``experiments/study/cycle_ablation_toy_crowded.yaml``).
``bind``: drawn as ``train`` but every other object has the target's size, so matching the size word alone is right
by chance only (issue 40); ``val_bind`` (its own code) is the held-out copy that ``bench/toy_yardstick.py`` reads.

Five held-out test splits that no training, validation or tuning reads (the study's evaluator, ``study/``): ``test_id``
is drawn as ``train`` / ``val``; each OOD kind of ``ood`` on its own, ``test_ood_texture`` (textured backgrounds,
in-domain objects) and ``test_ood_crowded`` (plain backgrounds, 4-8 look-alikes close to the target); ``test_ood`` both
at once, as ``ood``. ``test_multihop`` (EvolvedGRPO's held-out hard split): scenes drawn as ``test_id``'s and kept when
they admit the question (which favours scenes with more objects), asked with multi-step questions, half "the D left of /
above ... the anchor" (level 3, two steps), half two hops "the D right of the D' below the anchor" (level 5, three
steps), each exact on its scene (``core.toy.query.query_problem``). Adding them changed no existing split: a split's
scenes depend only on its own code.

Three splits with no-target queries (``no_target``): ``train_nt``, ``val_nt`` and the held-out ``test_nt`` are drawn
as ``train`` / ``val`` (on codes of their own), and a quarter of their queries name a near miss of the target that the
scene does not hold: "the small blue circle" beside a small red one, with no blue circle anywhere. Their answer is
``no target`` (``core.regions``), their solution ``[]``. CycleGRPO trains them as grounding groups; the GRPO rewards
refuse them (they need a box).

``train_multihop``: drawn as ``test_multihop`` on a code of its own, a training pool of questions too hard for the
toy checkpoint (EvolvedGRPO's "problems that are too hard": its runs step them back to their spelled-out steps,
``experiments/study/evolved_toy_multihop.yaml``).

``test_multihop_anchor``: ``test_multihop``'s scenes (the same code, so the same images), each asked the first step of
its question alone, "the yellow shape": scored against ``test_multihop``'s ``step1_acc50`` it tells whether a model
fails the anchor or only the anchor inside a chain. ``train_multihop_anchor``: the same for ``train_multihop``'s
scenes, for SFT mixes that train a chain's anchors as one-step questions of the scenes the chains are drawn from.

``train_short`` / ``test_short``: drawn as ``train`` / ``test_id`` (codes of their own), the target asked by its
shortest exact descriptor ("the yellow shape", the form of a multi-step question's anchors) instead of its triple
(why: experiments/toy_model_runs.md, "The anchors' query form")."""


TEST_SPLITS = ("test_id", "test_ood_texture", "test_ood_crowded", "test_ood", "test_multihop")
"""The held-out splits, in the order the study's table shows them."""


class Triple(NamedTuple):
    size: str
    colour: str
    shape: str


_CHOICES = (SIZES, OBJECT_COLOURS, SHAPES)  # in Triple's field order


def _pick(rng: np.random.Generator, values: Sequence[str]) -> str:
    return values[int(rng.integers(len(values)))]


def _random_triple(rng: np.random.Generator, colours: Sequence[str] = OBJECT_COLOURS) -> Triple:
    return Triple(_pick(rng, SIZES), _pick(rng, colours), _pick(rng, SHAPES))


def _variant(rng: np.random.Generator, target: Triple, share: bool, avoid_colour: str | None = None) -> Triple:
    """A triple different from ``target``. ``share``: keeps exactly one or two of its attributes (chosen at random),
    the rest change; else uniformly random. Never uses ``avoid_colour``."""
    if not share:
        colours = [c for c in OBJECT_COLOURS if c != avoid_colour]
        while True:
            t = _random_triple(rng, colours)
            if t != target:
                return t
    keep = set(rng.choice(3, size=int(rng.integers(1, 3)), replace=False).tolist())
    if avoid_colour == target.colour:
        keep.discard(1)
        keep = keep or {int(rng.choice([0, 2]))}
    values = []
    for i, choices in enumerate(_CHOICES):
        if i in keep:
            values.append(target[i])
        else:
            values.append(_pick(rng, [v for v in choices if v != target[i] and v != avoid_colour]))
    return Triple(*values)


def _at_size(rng: np.random.Generator, target: Triple, t: Triple) -> Triple:
    """``t`` at the target's size, its colour and shape drawn again while both are the target's."""
    while (t.colour, t.shape) == (target.colour, target.shape):
        t = Triple(t.size, _pick(rng, OBJECT_COLOURS), _pick(rng, SHAPES))
    return t._replace(size=target.size)


def _side(rng: np.random.Generator, size: str, image_size: int) -> int:
    lo, hi = SIZE_FRACTIONS[size]
    return max(3, int(round(rng.uniform(lo, hi) * image_size)))


def _place(
    rng: np.random.Generator,
    side: int,
    boxes: list[tuple[int, int, int, int]],
    image_size: int,
    near: tuple[int, int, int, int] | None = None,
    gap: int = 3,
    tries: int = 64,
) -> tuple[int, int, int, int] | None:
    """A ``side x side`` box inside the image, ``gap`` pixels clear of ``boxes``; with ``near``, within reach of that
    box. The first free candidate of ``tries`` random ones, or None."""
    lo, hi = 2, image_size - side - 2
    if hi < lo:
        return None
    xlo, xhi, ylo, yhi = lo, hi, lo, hi
    if near is not None:
        reach = int(0.1 * image_size)
        xlo, xhi = max(lo, near[0] - side - reach), min(hi, near[2] + reach)
        ylo, yhi = max(lo, near[1] - side - reach), min(hi, near[3] + reach)
    return first_free_square(rng, side, boxes, (xlo, xhi, ylo, yhi), gap, tries)


def _rng(seed: int, split: str, task: str, index: int, attempt: int = 0) -> np.random.Generator:
    if seed < 0:
        raise ValueError(f"--seed must be >= 0, got {seed}")
    key = [seed, SPLITS[split].code, TASKS.index(task), index] + ([attempt] if attempt else [])
    return np.random.default_rng(np.random.SeedSequence(key))


HARD_QUERY_ATTEMPTS = 64
"""Draws of a ``text_levels`` scene before giving up (a two-hop query exists on about a third of in-domain scenes)."""


def _check_args(split: str, task: str, size: int) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {tuple(SPLITS)}")
    if task not in TASKS:
        raise ValueError(f"--task must be one of {TASKS}, got {task!r}")
    if size < 64:
        raise ValueError(f"--size must be >= 64 pixels for shapes to stay recognisable, got {size}")


def make_scene(split: str, index: int, seed: int, size: int = 224, task: str = "rec") -> dict[str, Any]:
    """One scene record: the JSONL keys of docs/interfaces.md with ``image`` a PIL image, and ``meta`` the scene."""
    _check_args(split, task, size)
    levels = SPLITS[split].text_levels
    if task == "isr":
        return _isr_scene(split, index, seed, size, _rng(seed, split, task, index))
    if SPLITS[split].single_attr and task == "rec":
        for attempt in range(HARD_QUERY_ATTEMPTS):
            rec = _draw_scene(split, index, seed, size, task, _rng(seed, split, task, index, attempt))
            pick = np.random.default_rng(
                np.random.SeedSequence([seed, SPLITS[split].code, index, attempt, _SINGLE_TAG])
            )
            if _single_attr_query(rec, pick):
                return rec
        raise RuntimeError(
            f"{split} scene {index} (seed {seed}): no target with a unique attribute in "
            f"{HARD_QUERY_ATTEMPTS} draws; the split draws too many objects for one to be unique: lower "
            f"SPLITS[{split!r}].others in datamodules/toy.py"
        )
    if not levels:
        rec = _draw_scene(split, index, seed, size, task, _rng(seed, split, task, index))
        if SPLITS[split].short_query and task == "rec":
            _short_query(
                rec, np.random.default_rng(np.random.SeedSequence([seed, SPLITS[split].code, index, _SHORT_TAG]))
            )
        if SPLITS[split].no_target and task == "rec":
            rng = np.random.default_rng(np.random.SeedSequence([seed, SPLITS[split].code, index, _NO_TARGET_TAG]))
            if rng.random() < SPLITS[split].no_target:
                _no_target_query(rec, rng)
        return rec
    if task != "rec":
        raise ValueError(f"split {split!r} asks REC questions (a referred object); --task rec, got {task!r}")
    level = levels[index % len(levels)]
    for attempt in range(HARD_QUERY_ATTEMPTS):
        rng = _rng(seed, split, task, index, attempt)
        rec = _draw_scene(split, index, seed, size, task, rng)
        query = edit_query(rec["meta"], rec["meta"]["query"], level, rng)
        if query is not None:
            rec["meta"].update(query=query, level=level)
            rec["conversations"][0]["value"] = f"<image>{query}"
            if SPLITS[split].ask_anchor:
                _ask_anchor(rec)
            return rec
    raise RuntimeError(
        f"{split} scene {index} (seed {seed}): no exact level-{level} question in {HARD_QUERY_ATTEMPTS} draws; the "
        f"split's SplitSpec (datamodules/toy.py SPLITS) draws too few objects for that level: widen its `others` "
        "range or raise HARD_QUERY_ATTEMPTS"
    )


def _ask_anchor(rec: dict[str, Any]) -> None:
    """Ask REC record ``rec``'s multi-step question's first step alone, in place: the anchor becomes the ``target``
    (the question's target an ``object``), the query and solution its own; ``meta["question"]`` keeps the question."""
    meta = rec["meta"]
    question = meta["query"]
    anchor = decompose(meta, question)[0]
    (k,) = resolve(parse_query(anchor.query), meta)
    meta["objects"][target_index(meta)]["role"] = "object"
    meta["objects"][k]["role"] = "target"
    meta.update(query=anchor.query, question=question)
    rec["solution"] = list(anchor.box)
    rec["conversations"] = [
        {"from": "human", "value": f"<image>{anchor.query}"},
        {"from": "gpt", "value": json.dumps(list(anchor.box))},
    ]


_SHORT_TAG = 7927
"""Enters the seed of a ``short_query`` split's per-index draw (which of the shortest descriptors is asked)."""


def _short_query(rec: dict[str, Any], rng: np.random.Generator) -> None:
    """Ask REC record ``rec``'s target by its shortest exact descriptor, in place: the fewest (one or two) of (size,
    colour, shape) that single it out among every object of the scene, "shape" standing for an unnamed shape ("the
    yellow shape"); one of the shortest at random. A target that needs all three keeps its query."""
    meta = rec["meta"]
    t = target_index(meta)
    descs = [d for d in _descs(meta["objects"][t], min_attrs=1) if resolve(NP(d), meta) == [t]]
    n_attrs = [sum(v is not None for v in (d.size, d.colour, d.shape)) for d in descs]
    fewest = min(n_attrs, default=3)
    if fewest == 3:  # only the full triple is exact: the query already is it
        return
    shortest = [d for d, n in zip(descs, n_attrs) if n == fewest]
    query = format_query(NP(shortest[int(rng.integers(len(shortest)))]))
    meta["query"] = query
    rec["conversations"][0]["value"] = f"<image>{query}"


_SINGLE_TAG = 7933
"""Enters the seed of a ``single_attr`` split's per-draw choice (which unique attribute is asked)."""


def _single_attr_query(rec: dict[str, Any], rng: np.random.Generator) -> bool:
    """Ask REC record ``rec``'s target by one attribute that only it wears, in place, one of them at random; False
    (``rec`` untouched) when every attribute of the target is shared with another object of the scene."""
    meta = rec["meta"]
    t = target_index(meta)
    target = meta["objects"][t]
    descs = [d for d in (Desc(**{a: target[a]}) for a in ATTRS) if resolve(NP(d), meta) == [t]]
    if not descs:
        return False
    query = format_query(NP(descs[int(rng.integers(len(descs)))]))
    meta["query"] = query
    rec["conversations"][0]["value"] = f"<image>{query}"
    return True


_NO_TARGET_TAG = 7919
"""Enters the seed of a ``no_target`` split's per-index draw (whether the query names nothing, and what)."""


def _no_target_query(rec: dict[str, Any], rng: np.random.Generator) -> None:
    """Turn REC record ``rec`` into a no-target one, in place: its query names the target's triple with its colour or
    its shape changed, to a (colour, shape) pair that no object of the scene (foreground or painted) wears in any
    size; the former target becomes an ``object``, ``solution`` is ``[]``, ``meta["no_target"]`` is true. The image is
    untouched. Size-only misses ("the large red circle" beside a small one) are not drawn: the toy model, which
    reads sizes only relative to look-alikes, never learnt to reject them (docs/cycle_grpo.md)."""
    meta = rec["meta"]
    target = next(o for o in meta["objects"] if o["role"] == "target")
    worn = {(o["colour"], o["shape"]) for o in meta["objects"]}
    size, colour, shape = target["size"], target["colour"], target["shape"]
    misses = [Triple(size, c, shape) for c in OBJECT_COLOURS if (c, shape) not in worn] + [
        Triple(size, colour, sh) for sh in SHAPES if (colour, sh) not in worn
    ]  # never empty: at most 12 objects, and the target's colour and shape have 7 + 5 alternatives
    miss = misses[int(rng.integers(len(misses)))]
    query = f"the {miss.size} {miss.colour} {miss.shape}"
    target["role"] = "object"
    meta.update(query=query, no_target=True)
    rec["solution"] = []
    rec["conversations"] = [{"from": "human", "value": f"<image>{query}"}, {"from": "gpt", "value": "[]"}]


def _draw_scene(split: str, index: int, seed: int, size: int, task: str, rng: np.random.Generator) -> dict[str, Any]:
    spec = SPLITS[split]
    n_others = int(rng.integers(spec.others[0], spec.others[1] + 1))
    # OOD keeps at least one foreground object and one painted distractor; in-domain splits anything goes
    n_painted = int(rng.integers(1, n_others)) if spec.near else int(rng.integers(0, n_others + 1))
    n_fore = n_others - n_painted

    if task == "rec":
        target = _random_triple(rng)
        targets = [target]
        fore = [_variant(rng, target, spec.share) for _ in range(n_fore)]
        painted = _variant(rng, target, spec.share) if n_painted else None
        if spec.same_size:
            fore, painted = [_at_size(rng, target, t) for t in fore], painted and _at_size(rng, target, painted)
    else:  # ovd: one to three objects of the queried colour; nothing else wears it
        colour = _pick(rng, OBJECT_COLOURS)
        targets = [_random_triple(rng, [colour]) for _ in range(int(rng.integers(1, 4)))]
        fore = [_variant(rng, targets[int(rng.integers(len(targets)))], spec.share, colour) for _ in range(n_fore)]
        painted = _variant(rng, targets[0], spec.share, colour) if n_painted else None

    # Foreground boxes: targets first (they must fit), then the others; an object that finds no room is dropped.
    boxes: list[tuple[int, int, int, int]] = []
    objects: list[dict[str, Any]] = []
    for role, triple in [("target", t) for t in targets] + [("object", t) for t in fore]:
        side = _side(rng, triple.size, size)
        near = boxes[0] if (spec.near and boxes and role == "object") else None
        box = _place(rng, side, boxes, size, near) or (_place(rng, side, boxes, size) if near else None)
        if box is None:
            if role == "target":
                box = _place(rng, side, boxes, size, tries=4096)
                if box is None:
                    raise RuntimeError(f"{split} scene {index}: no room for a target; grammar.SIZE_FRACTIONS too large")
            else:
                continue
        boxes.append(box)
        objects.append({"role": role, **triple._asdict(), "box": list(box)})

    used = {o["colour"] for o in objects} | ({painted.colour} if painted else set())
    free = [c for c in grammar.COLOURS if c not in used]
    kind = _pick(rng, spec.backgrounds)
    colour = _pick(rng, free)
    colour2 = _pick(rng, [c for c in free if c != colour]) if kind != "plain" else None
    if painted is None:
        description = Description(kind, colour, colour2)
    else:
        description = Description(
            kind, colour, colour2, grammar.count_word(n_painted), painted.shape, painted.colour, painted.size
        )

    canvas = np.zeros((size, size, 3), dtype=np.uint8)
    keep = np.zeros((size, size), dtype=bool)
    for obj in objects:
        drawn = grammar.draw_shape(canvas, obj["shape"], obj["colour"], obj["box"], mask=keep)
        assert drawn == tuple(obj["box"]), "shape masks fill their box"
    avoid = np.zeros((size, size), dtype=bool)
    for x1, y1, x2, y2 in boxes:
        avoid[max(0, y1 - 3) : y2 + 3, max(0, x1 - 3) : x2 + 3] = True
    render_seed = int(rng.integers(2**31))
    image, placed = grammar.render_with_layout(
        Image.fromarray(canvas), keep, description, render_seed, n_distractors=n_painted, avoid_mask=avoid
    )
    objects += [
        {"role": "distractor", "size": p.size, "colour": p.colour, "shape": p.shape, "box": list(p.box)} for p in placed
    ]

    if task == "rec":
        query = f"the {target.size} {target.colour} {target.shape}"
        solution: list = list(objects[0]["box"])
    else:
        query = f"every {targets[0].colour} shape"
        solution = sorted((o["box"] for o in objects if o["role"] == "target"), key=lambda b: (b[1], b[0]))
    prefix = "toy" if task == "rec" else "toy-ovd"
    meta = {
        "split": split,
        "index": index,
        "seed": seed,
        "task": task,
        "width": size,
        "height": size,
        "query": query,
        "objects": objects,
        "description": str(description),
        "render_seed": render_seed,
    }
    meta["difficulty"] = round(difficulty(meta), 4)
    return {
        "id": f"{prefix}-{split}-{index:06d}",
        "image": image,
        "conversations": [
            {"from": "human", "value": f"<image>{query}"},
            {"from": "gpt", "value": json.dumps(solution)},
        ],
        "solution": solution,
        "task": task,
        "width": size,
        "height": size,
        "meta": meta,
    }


def _isr_scene(split: str, index: int, seed: int, size: int, rng: np.random.Generator) -> dict[str, Any]:
    """A toy ISR room (``core.toy.indoor``): the split is out-of-domain when its backgrounds are textured (``ood``,
    ``test_ood*``). The record is an OVD sample (``task: ovd``), as ``datamodules.isr`` writes rendered views."""
    room = indoor_scene(rng, size, ood=set(SPLITS[split].backgrounds) <= set(grammar.TEXTURED_BACKGROUNDS))
    query, solution = room["query"], room["solution"]
    objects = [
        {"role": "target" if o["category"] == query else "object", "shape": o["category"], "size": "medium", **o}
        for o in room["objects"]
    ]
    meta = {"split": split, "index": index, "seed": seed, "task": "ovd", "source": "toy-isr", "width": size,
            "height": size, "query": query, "objects": objects, "categories": sorted({o["category"] for o in objects}),
            "description": str(Description("plain", room["wall"])), "wall": room["wall"], "floor": room["floor"]}  # fmt: skip
    meta["difficulty"] = round(difficulty(meta), 4)
    return {
        "id": f"toy-isr-{split}-{index:06d}",
        "image": room["image"],
        "conversations": [
            {"from": "human", "value": f"<image>{query}"},
            {"from": "gpt", "value": json.dumps(solution)},
        ],
        "solution": solution,
        "task": "ovd",
        "width": size,
        "height": size,
        "meta": meta,
    }


def iter_split(split: str, n: int, seed: int, size: int = 224, task: str = "rec") -> Iterator[dict[str, Any]]:
    for index in range(n):
        yield make_scene(split, index, seed, size, task)


EVOLVE_LEVELS = (1, 2, 3, 3, 4, 5, 5)
"""Levels an evolved SFT scene is drawn from (``ToySceneDataset(evolve=...)``), uniformly over this tuple."""


class ToySceneDataset:
    """Scenes of a split rendered on access (index -> ``make_scene``), as ``core.records.Sample``.

    The same scenes ``export_jsonl`` writes, without the PNG round trip: a long SFT run draws hundreds of thousands
    of fresh scenes from loader workers instead of cycling over a few thousand files. Sample ids, queries, boxes and
    ``meta`` match what ``read_jsonl`` makes of the exported line.
    """

    def __init__(
        self,
        split: str,
        n: int,
        seed: int,
        size: int = 224,
        task: str = "rec",
        mix: dict[str, float] | None = None,
        evolve: float = 0.0,
    ):
        _check_args(split, task, size)
        if not 0.0 <= evolve <= 1.0 or (evolve and task != "rec"):
            raise ValueError(f"--data.toy.evolve must lie in [0, 1] and needs task rec, got {evolve} ({task})")
        self.evolve = evolve
        self.mix = dict(mix or {})
        for name, frac in self.mix.items():
            if name not in SPLITS or name == split:
                raise ValueError(f"--data.toy.mix: unknown or repeated split {name!r}; choose from {tuple(SPLITS)}")
            if not 0.0 <= frac <= 1.0:
                raise ValueError(f"--data.toy.mix: fraction of {name!r} must lie in [0, 1], got {frac}")
        if sum(self.mix.values()) > 1.0:
            raise ValueError(f"--data.toy.mix: fractions sum to {sum(self.mix.values())} > 1")
        self.split, self.n, self.seed, self.size, self.task = split, n, seed, size, task

    def __len__(self) -> int:
        return self.n

    def split_of(self, index: int) -> str:
        """The split scene ``index`` is drawn from: ``mix`` takes fixed, evenly spread fractions of the indices (by a
        hash of the index), the rest is ``split``."""
        u = (index * 2654435761) % 2**32 / 2**32
        for name, frac in self.mix.items():
            if u < frac:
                return name
            u -= frac
        return self.split

    def __getitem__(self, index: int):
        if not 0 <= index < self.n:
            raise IndexError(f"scene {index} out of range for {self.n} {self.split} scenes")
        rec = make_scene(self.split_of(index), index, self.seed, self.size, self.task)
        boxes = ([rec["solution"]] if rec["solution"] else []) if self.task == "rec" else rec["solution"]
        image, query, meta = rec["image"], rec["meta"]["query"], rec["meta"]
        rng = np.random.default_rng([self.seed, index, 18])
        if self.evolve and boxes and rng.random() < self.evolve:  # an evolved version of the scene, when one exists
            # relations and two hops (levels 3 and 5: the multi-step questions) twice as often as the other levels;
            # text edits three times as often as visual ones (the step format is what the stage teaches)
            level = Level(int(rng.choice(EVOLVE_LEVELS)), bool(rng.random() < 0.5))
            out = evolve(rec, level, rng, modality="text" if rng.random() < 0.75 else "visual")
            if out is not None:
                image, query, meta = out.image, out.query, {**out.meta, "level": level.level}
        return Sample(
            sample_id=rec["id"],
            image=image,
            query=query,
            boxes=[[float(v) for v in b] for b in boxes],
            task=self.task,
            source=f"toy:{rec['meta']['split']}:{index}",
            meta=meta,
        )


def generate_split(split: str, n: int, seed: int, size: int = 224, task: str = "rec") -> list[dict[str, Any]]:
    """``n`` scene records of ``split`` (``image`` is a PIL image; see ``make_scene``)."""
    return list(iter_split(split, n, seed, size, task))


# --- export ----------------------------------------------------------------------------------------------------------


def jsonl_path(out_dir: str | Path, split: str, task: str = "rec") -> Path:
    """``out_dir/{split}.jsonl`` for REC, ``out_dir/{split}_ovd.jsonl`` for OVD (the two can share a folder)."""
    return Path(out_dir) / (f"{split}.jsonl" if task == "rec" else f"{split}_{task}.jsonl")


def export_jsonl(out_dir: str | Path, split: str, n: int, seed: int, task: str = "rec", size: int = 224) -> Path:
    """Write ``n`` scenes of ``split`` as PNGs under ``out_dir/images/`` and a VLM-R1 JSONL (``jsonl_path``) whose
    image paths are relative to ``out_dir``; returns the JSONL path.

    Idempotent: a manifest next to the JSONL records the parameters, and a call with the same parameters whose
    files all exist returns at once. Every file is written to a temp name and renamed; the manifest goes last.
    """
    _check_args(split, task, size)
    params = {
        "generator": "datamodules.toy",
        "version": TOY_VERSION,
        "split": split,
        "n": n,
        "seed": seed,
        "size": size,
        "task": task,
    }
    return export_rows(jsonl_path(out_dir, split, task), params, iter_split(split, n, seed, size, task))


def split_counts(parser, items: Sequence[str], splits) -> list[tuple[str, int]]:
    """A command's ``--splits split:count ...`` as ``(split, count)`` pairs; ``parser.error`` on a bad item."""
    pairs = []
    for item in items:
        split, _, count = item.partition(":")
        if split not in splits or not count.isdigit():
            parser.error(f"--splits takes split:count with split in {tuple(splits)}, got {item!r}")
        pairs.append((split, int(count)))
    return pairs


def main(argv: Sequence[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(prog="python -m datamodules.toy", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("data/toy"), help="output folder (images/ and *.jsonl)")
    default = ["train:512", "val:128", "ood:128"]
    parser.add_argument(
        "--splits", nargs="+", default=default, help="split:count pairs, splits from " + ", ".join(SPLITS)
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=224, help="square image side in pixels")
    parser.add_argument("--task", choices=TASKS, default="rec")
    args = parser.parse_args(argv)
    paths = []
    for split, count in split_counts(parser, args.splits, SPLITS):
        paths.append(export_jsonl(args.out, split, count, args.seed, args.task, args.size))
        print(paths[-1])
    return paths


def export_offline_descriptions(
    out_dir: str | Path, split: str = "train", per_sample: int = 5, seed: int = 0, task: str = "rec"
) -> Path:
    """Fixed grammar descriptions for every sample of an exported split: the toy stand-in for the paper's GPT-4o
    descriptions ("GRPO + Offline Generation"). Lines ``{"sample_id", "description"}``, ``per_sample`` per sample
    (the synthesis callback uses the ``epoch % per_sample``-th). Idempotent and atomic."""
    src = jsonl_path(out_dir, split, task)
    path = Path(out_dir) / f"{src.stem}_offline_descriptions.jsonl"
    if path.exists() and path.stat().st_mtime >= src.stat().st_mtime:
        return path
    lines = []
    for line in src.read_text().splitlines():
        rec = json.loads(line)
        rng = np.random.default_rng([seed, zlib.crc32(rec["id"].encode())])
        for _ in range(per_sample):
            text = guard_description(str(grammar.random_description(rng)), rec.get("meta") or {})
            lines.append(json.dumps({"sample_id": rec["id"], "description": text}) + "\n")
    claim(path.parent)  # a folder of other files stops it here
    atomic_write(path, lambda tmp: tmp.write_text("".join(lines)))
    return path


if __name__ == "__main__":
    main()
