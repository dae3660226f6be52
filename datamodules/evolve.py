"""Instruction evolution on the toy world (EvolvedGRPO's building blocks): textual and visual edits with exact labels,
sub-problems with prefix-style process rewards, and the per-sample difficulty level.

EvolvedGRPO (docs/evolved_grpo.md) keeps GRPO's groups from converging to one reward by editing each question to be
harder once the model solves it, in two modalities, and by stepping a too-hard question back to sub-problems. On the
toy world every edit keeps the label exact because the scene model is known:

- **Textual edits** (``edit_plans.edit_query``): a new referring expression for the *same* target object, unique in
  the scene under the query semantics of ``core.toy.query``, by level: attributes (+ a location), negation, one
  spatial relation, ordinal (counting), two-hop relation. ``None`` when no such query exists at that level: never an
  ambiguous one.
- **Visual edits** (``edit_plans.plan_visual_edit`` -> a job dict ``{"kind", "params"}`` -> ``execute_job``): closer
  look-alikes of the target, clutter (a textured background with more painted distractors), occlusion of non-target
  objects, and the visual sub-problems "declutter" and, easier, "isolate" (declutter, and every other object the
  query does not need removed). The job holds everything needed to re-render (boxes, description, seeds), so a
  data server can execute it; here ``execute_job`` runs the toy renderer. The target's pixels and box never change.
- **Sub-problems** (``core.toy.query.decompose``): a relational query's chain of steps (anchor, ..., target), each a
  valid REC query with an exact box; the model writes one ``<step>[box]</step>`` per step inside ``<think>`` and
  ``prefix_process_reward`` credits the correct prefix (docs/decisions.md, "EvolvedGRPO's edits").
- **Levels** (``LevelState``): per-sample ``(level, sub)``; a group that is all correct goes harder, one that is all
  wrong steps back to the sub-problem version (with ``sub_levels=2`` then to the easier, isolated one), then a level
  down.

The pieces live where their layer is: the query language and its semantics in ``core/toy/query.py``, the scene
model and renderer in ``core/toy/scene.py``, the execution of visual edits in ``core/toy/edits.py`` (the data server
runs it too), the planning of edits in ``datamodules/edit_plans.py``; this module holds the sub-problems' process
reward, the levels and ``evolve``, which makes the version of a sample at a level.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
from PIL import Image

from core.boxes import extract_boxes, iou, rescale_box
from core.toy.edits import ISOLATE_KIND, SUB_VISUAL_KIND, SUB_VISUAL_KINDS, VISUAL_KINDS, ZOOM_KIND, execute_job
from core.toy.query import GUIDE_MARK, Step, decompose, guided_query
from core.toy.scene import render_meta, target_index
from datamodules.edit_plans import MAX_LEVEL, TEXT_KINDS, edit_query, plan_visual_edit

EASIER_KINDS = (ISOLATE_KIND, ZOOM_KIND)
"""What the easier version below a sub-problem (``Level.sub == 2``) can be (``evolve``'s ``easier``)."""
EASIER_LABELS = {ISOLATE_KIND: "isolated", ZOOM_KIND: "zoomed"}
"""How the logs name a sample in each easier version (``LevelState.stats``: ``level/<label>_frac``)."""


# --- sub-problems and the prefix-style process reward ----------------------------------------------------------------


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


_STEP_RE = re.compile(r"<step>(.*?)</step>", re.DOTALL)


def parse_steps(text: str, answer_tag: str = "answer") -> list[list[float] | None]:
    """The boxes of the ``<step>...</step>`` parts written before the first ``<answer>``, in order; a step whose
    content holds no box is None (it breaks the prefix). Never raises."""
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
    "EASIER_KINDS",
    "EASIER_LABELS",
    "Evolved",
    "Level",
    "LevelState",
    "combine_rewards",
    "evolve",
    "is_sub_problem",
    "job_json",
    "next_level",
    "parse_steps",
    "prefix_credit",
    "prefix_process_reward",
    "query_steps",
    "render_meta",  # core.toy.scene's, re-exported for lightning_modules.methods.evolved_grpo (`evolve.render_meta`)
    "version_depth",
    "written_steps",
]
