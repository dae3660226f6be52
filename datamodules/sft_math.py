"""The toy math SFT stage's data: EvolvedGRPO's answer model A and question generator Q taught on toy math rows.

The tiny EvolvedGRPO runs (configs/evolved_answer_tiny.yaml, evolved_question_tiny.yaml) start from a toy checkpoint.
The grounding checkpoints never saw a math problem: A never boxes an answer and Q never writes the JSON, so both
rewards stay 0 and GRPO has nothing to climb. This stage warm-starts one shared checkpoint on both roles, on rows of
the toy visual-math world (``datamodules.toy_math``), whose scenes give every target exactly:

- **A** (``role = "answer"``, under A's prompt ``reasoning.answer_prompt``): a short reasoning read off the scene,
  then the box, e.g. ``<think>I count 3 red shapes and 1 blue shape. 3 - 1 = 2.</think> \\boxed{2}``
  (:func:`answer_target`). A share of the numeric rows (``follow_share``) is first composed with one or two toy
  follow-ups, the problems Q's text edits make; their reasoning gives x, then each step (``So x = 2 and 2 + 3 = 5.``).
- **Q** (``role = "question"``, under Q's prompt ``methods.question_generator.question_prompt``): one JSON object
  with one key, ``{"follow_up_problem": "What is x + 3?"}`` (a follow-up of the toy grammar that
  ``core.toy_math.parse_follow_up`` reads) or ``{"edit_instruction": "Change the background to cream."}`` (an
  instruction of ``core.toy_math.edits``' grammar that keeps the row's answer, checked by executing it). Both are
  drawn per row with a generator seeded by the row id, so Q sees many follow-ups and instructions, not one.

A row is a Q row with probability ``question_share`` (default 0.25: A:Q = 3:1), fixed by its id; a Q row is an image
edit with probability ``image_share`` (default 0.25, above the run's 10% partition so the rarer prompt is learnt; the
prompt names the key, so the share only sets how often each is seen). A text-edit Q row needs a numeric answer (a
follow-up is a function of x): a choice-letter row asked as a Q row gets an image edit.

The prompts themselves are built by ``lightning_modules.sft`` (``pair_prompt``) from the GRPO methods' own prompt
functions, so what this stage teaches is exactly what the RL runs ask; this layer only says the role, the problem, the
answer and the completion (:class:`MathPair`).
"""

from __future__ import annotations

import json
import zlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from core.coevolution import EDIT_KEYS
from core.toy import grammar
from core.toy_math.edits import BACKGROUNDS, InstructionError, edit_problem
from core.toy_math.follow_up import FollowUp, parse_follow_up, random_follow_up
from core.toy_math.world import LETTERS, evaluate
from datamodules.reasoning import (
    ReasoningDataModule,
    ReasoningDataset,
    ReasoningRecord,
    ReasoningSample,
    collate_reasoning,
    load_reasoning_sample,
)
from datamodules.toy_math import follow_up_row

__all__ = [
    "MathPair",
    "MathPairDataset",
    "SFTReasoningDataModule",
    "answer_reasoning",
    "answer_target",
    "edit_in_grammar",
    "edit_instruction_target",
    "follow_up_target",
    "math_pair",
]

ROLES = ("answer", "question")


def _rng(*key: Any) -> np.random.Generator:
    """A generator fixed by ``key`` (strings and ints), independent of the global RNGs and of the loader worker."""
    return np.random.default_rng([zlib.crc32(str(k).encode()) for k in key])


def _draw(*key: Any) -> float:
    return float(_rng(*key).random())


# --- A: reasoning and box --------------------------------------------------------------------------------------------


def _count(n: int, colour: str | None, shape: str | None) -> str:
    """``3 red circles``, ``1 blue shape``, ``2 stars``."""
    noun = (shape if n == 1 else grammar.plural(shape)) if shape else ("shape" if n == 1 else "shapes")
    return f"{n} {colour + ' ' if colour else ''}{noun}"


def _listing(parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else f"{', '.join(parts[:-1])} and {parts[-1]}"


def _sum_sentence(values: list[int], total: int) -> str:
    return f" {' + '.join(map(str, values))} = {total}." if len(values) > 1 else ""


def _base_reasoning(scene: dict[str, Any], query: dict[str, Any]) -> str:
    """The reasoning of a one-step toy math problem, read off its scene (``core.toy_math.world``)."""
    op = query["op"]
    if op == "count":
        colour, shape = query["colour"], query["shape"]
        hits = [o for o in scene["objects"] if colour in (None, o["colour"]) and shape in (None, o["shape"])]
        if colour and shape:
            return f"I count {_count(len(hits), colour, shape)}."
        by = "shape" if colour else "colour"  # break the count down by the attribute the question leaves open
        groups = Counter(o[by] for o in hits)
        parts = [_count(n, colour, k) if by == "shape" else _count(n, k, shape) for k, n in groups.items()]
        return f"I count {_listing(parts)}.{_sum_sentence(list(groups.values()), len(hits))}"
    if op == "count_diff":
        counts = Counter(o["colour"] for o in scene["objects"])
        a, b = counts[query["a"]], counts[query["b"]]
        return f"I count {_count(a, query['a'], None)} and {_count(b, query['b'], None)}. {a} - {b} = {a - b}."
    if op == "most_choice":
        counts = Counter(o["colour"] for o in scene["objects"])
        options = query["options"]
        best = max(options, key=lambda c: counts[c])
        listed = _listing([f"{counts[c]} {c}" for c in options])
        return f"I count {listed} shapes. The most are {best}, option {LETTERS[options.index(best)]}."
    values = {b["colour"]: b["value"] for b in scene["bars"]}
    if op == "bar_value":
        return f"The {query['colour']} bar reaches {values[query['colour']]}."
    heights = [b["value"] for b in scene["bars"]]
    if op == "bar_total":
        return f"The bars are {', '.join(map(str, heights))}.{_sum_sentence(heights, sum(heights))}"
    if op == "bar_range":
        hi, lo = max(heights), min(heights)
        return f"The tallest bar is {hi} and the shortest is {lo}. {hi} - {lo} = {hi - lo}."
    raise ValueError(f"unknown toy math query op {op!r} (core.toy_math.world.KINDS)")


_EXPR = {"add": "{x} + {k}", "sub": "{x} - {k}", "mul": "{k} * {x}", "rsub": "{k} - {x}", "square": "{x} * {x}"}


def answer_reasoning(meta: dict[str, Any]) -> str:
    """The reasoning of a toy math row (its ``meta``: ``scene``, ``query``, ``follow_ups``): the base problem read off
    the scene, then for each follow-up ``So x = <x> and <x op k> = <y>.``"""
    scene, query = meta["scene"], meta["query"]
    text, x = _base_reasoning(scene, query), evaluate(scene, query)
    for f in meta.get("follow_ups") or []:
        step = FollowUp(f["op"], int(f.get("k", 0)))
        y = step.apply(x)
        text += f" So x = {x} and {_EXPR[step.op].format(x=x, k=step.k)} = {y}."
        x = y
    return text


def answer_target(meta: dict[str, Any], answer: str) -> str:
    """A's completion: ``<think>`` the reasoning ``</think> \\boxed{answer}`` (``core.math_grading.format_ok``)."""
    return f"<think>{answer_reasoning(meta)}</think> \\boxed{{{answer}}}"


# --- Q: one JSON key --------------------------------------------------------------------------------------------------

_PHRASINGS = {
    "add": ("What is x + {k}?", "Compute x + {k}.", "Find {k} + x."),
    "sub": ("What is x - {k}?", "Compute x - {k}."),
    "mul": ("What is {k} times x?", "Find {k}x.", "Compute {k} * x."),
    "rsub": ("What is {k} - x?", "Compute {k} - x."),
    "square": ("What is x squared?", "Compute x^2.", "Find the square of x."),
}
"""Ways of writing each follow-up that ``parse_follow_up`` reads back to the same op and constant."""


def follow_up_target(rng: np.random.Generator) -> str:
    """Q's text-edit completion: ``{"follow_up_problem": "<a toy follow-up, in one of its phrasings>"}``."""
    step = random_follow_up(rng)
    phrasing = _PHRASINGS[step.op][int(rng.integers(len(_PHRASINGS[step.op])))]
    return json.dumps({EDIT_KEYS["text"]: phrasing.format(k=step.k)})


def _instruction_candidates(scene: dict[str, Any], rng: np.random.Generator) -> list[list[str]]:
    """Instructions of the toy edit grammar that may apply to ``scene``, by category (the caller checks each)."""
    backgrounds = [b for b in BACKGROUNDS if b != "white"]
    out = [
        [f"Change the background to {b}." for b in backgrounds] + [f"Make the background {b}." for b in backgrounds],
        ["Add some noise to the background.", "Add light noise.", "Add heavy noise.", "Add some speckles."],
    ]
    if scene["kind"] == "bars":
        out.append(["Darken the grid lines.", "Make the bars thinner.", "Make the bars wider.", "Thicken the bars."])
        return out
    unique = [o for o in scene["objects"] if sum(p["colour"] == o["colour"] and p["shape"] == o["shape"]
                                                  for p in scene["objects"]) == 1]  # fmt: skip
    moves = [f"Move the {o['colour']} {o['shape']} {d}." for o in unique for d in ("left", "right", "up", "down")]
    sizes = sorted({o["colour"] for o in scene["objects"]})
    resize = [f"Make the {c} shapes {w}." for c in sizes for w in ("bigger", "smaller")]
    return out + [c for c in (moves, resize) if c]


def edit_instruction_target(meta: dict[str, Any], rng: np.random.Generator) -> str:
    """Q's image-edit completion: ``{"edit_instruction": "..."}``, an instruction of the toy edit grammar that keeps
    the row's answer (``core.toy_math.edits.edit_problem`` runs it; a category is drawn, then an instruction in it
    that applies; backgrounds always do)."""
    categories = _instruction_candidates(meta["scene"], rng)
    for c in rng.permutation(len(categories)):
        options = categories[int(c)]
        for i in rng.permutation(len(options)):
            try:
                edit_problem(meta, options[int(i)])
            except InstructionError:
                continue
            return json.dumps({EDIT_KEYS["image"]: options[int(i)]})
    raise ValueError(f"no toy edit instruction keeps the answer of scene {meta['scene'].get('kind')!r}")


def edit_in_grammar(pair: MathPair, edit_text: str) -> bool:
    """Whether Q's edit text for ``pair`` is one the toy world executes exactly: a follow-up ``parse_follow_up``
    reads (text edit), or an instruction ``edit_problem`` applies with the answer kept (image edit)."""
    if pair.kind == "text":
        return parse_follow_up(edit_text) is not None
    try:
        edit_problem(pair.meta, edit_text)
    except (InstructionError, KeyError, TypeError, ValueError):
        return False
    return True


# --- pairs -----------------------------------------------------------------------------------------------------------


@dataclass
class MathPair:
    """One SFT example of the math stage: the role's prompt is built from ``problem`` / ``answer`` / ``kind`` by
    ``lightning_modules.sft_examples.pair_prompt``; ``completion`` is the target (without the end-of-turn token)."""

    sample_id: str
    image: Image.Image
    role: str
    """``answer`` (A) or ``question`` (Q)."""
    problem: str
    answer: str
    completion: str
    kind: str | None = None
    """Q's edit kind, ``text`` or ``image`` (``core.coevolution.EDIT_KEYS``); None for A."""
    meta: dict[str, Any] = field(default_factory=dict)


def _is_int(answer: str) -> bool:
    return answer.lstrip("-").isdigit()


def math_pair(
    sample: ReasoningSample,
    role: str,
    seed: int = 0,
    follow_share: float = 0.0,
    image_share: float = 0.25,
) -> MathPair:
    """The SFT pair of toy math row ``sample`` in ``role``; every draw (the follow-ups, Q's edit kind and edit) is
    seeded by (``seed``, row id), so a row gives the same pair in every epoch and loader worker."""
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    if "scene" not in sample.meta or "query" not in sample.meta:
        raise ValueError(
            f"{sample.source or sample.sample_id}: the math SFT targets are read off a toy math row's scene; this row "
            "has no meta.scene / meta.query (use rows of datamodules.toy_math, e.g. --data.toy)"
        )
    row = {"id": sample.sample_id, "problem": sample.problem, "answer": sample.answer, "meta": dict(sample.meta)}
    if role == "answer":
        rng = _rng(seed, sample.sample_id, "follow")
        if _is_int(row["answer"]) and rng.random() < follow_share:
            for _ in range(int(rng.integers(1, 3))):
                row = follow_up_row(row, random_follow_up(rng))
        return MathPair(sample.sample_id, sample.image, role, row["problem"], row["answer"],
                        answer_target(row["meta"], row["answer"]), meta=row["meta"])  # fmt: skip
    image = _draw(seed, sample.sample_id, "kind") < image_share or not _is_int(row["answer"])
    kind = "image" if image else "text"
    rng = _rng(seed, sample.sample_id, "edit")
    target = edit_instruction_target(row["meta"], rng) if image else follow_up_target(rng)
    return MathPair(sample.sample_id, sample.image, role, row["problem"], row["answer"], target, kind, row["meta"])


@dataclass(frozen=True)
class PairRecord:
    """What item ``i`` of a :class:`MathPairDataset` is: a row and its role. ``task`` is the role and ``boxes`` is
    empty, so the grounding evaluator (which reads eval sets' ``records``) finds nothing of its own to score here."""

    row: ReasoningRecord
    task: str
    boxes: tuple = ()


class MathPairDataset(Dataset):
    """Reasoning records as :class:`MathPair` items, each in the role its record says."""

    def __init__(self, records: list[PairRecord], seed: int, follow_share: float, image_share: float):
        self.records = list(records)
        self.seed, self.follow_share, self.image_share = seed, follow_share, image_share

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> MathPair:
        rec = self.records[i]
        sample = load_reasoning_sample(rec.row)
        return math_pair(sample, rec.task, self.seed, self.follow_share, self.image_share)


class SFTReasoningDataModule(ReasoningDataModule):
    """``ReasoningDataModule``'s toy math rows as SFT pairs for ``SFTModule`` (the math stage of the toy checkpoint).

    Args (besides ``ReasoningDataModule``'s):
        question_share: share of the training rows taught as Q rows (fixed by row id); the rest are A rows.
        image_share: share of Q rows given an image edit (fixed by row id); choice-letter rows always are.
        follow_share: share of the numeric A rows first composed with one or two toy follow-ups (training only:
            the validation sets stay as written, so A's scores compare with ``train.py test`` of the A config).
        question_val: validation sets also asked as Q rows, under the name ``<set>_q`` (logs ``valid_json``).
    """

    def __init__(
        self,
        *args: Any,
        question_share: float = 0.25,
        image_share: float = 0.25,
        follow_share: float = 0.35,
        question_val: list[str] | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        for name, value in (("question_share", question_share), ("image_share", image_share),
                            ("follow_share", follow_share)):  # fmt: skip
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"--data.init_args.{name} must lie in [0, 1], got {value}")
        self.question_share, self.image_share, self.follow_share = question_share, image_share, follow_share
        self.question_val = ["toy_math_val"] if question_val is None else list(question_val)
        self.train_collate = collate_reasoning
        """``SFTModule.setup`` replaces it with its own collate (tokenise in the loader workers)."""

    def _pairs(self, ds: ReasoningDataset, role: str | None, follow_share: float) -> MathPairDataset:
        roles = [role or ("question" if _draw(self.seed, r.sample_id, "role") < self.question_share else "answer")
                 for r in ds.records]  # fmt: skip
        records = [PairRecord(r, t) for r, t in zip(ds.records, roles)]
        return MathPairDataset(records, self.seed, follow_share, self.image_share)

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        if isinstance(self.train_set, ReasoningDataset):
            self.train_set = self._pairs(self.train_set, None, self.follow_share)
        for kind, sets in self.eval_sets.items():
            for name, ds in list(sets.items()):
                if not isinstance(ds, ReasoningDataset):
                    continue
                sets[name] = self._pairs(ds, "answer", 0.0)
                if kind == "val" and name in self.question_val:
                    sets[f"{name}_q"] = self._pairs(ds, "question", 0.0)
        missing = [n for n in self.question_val if self.eval_sets["val"] and n not in self.eval_sets["val"]]
        if missing and stage in (None, "fit", "validate"):
            raise ValueError(
                f"--data.init_args.question_val names {missing}, not validation sets {self.eval_names('val')}"
            )

    def train_dataloader(self):
        if self.train_set is None:
            return super().train_dataloader()
        import torch

        return DataLoader(self.train_set, batch_size=self.batch_size, shuffle=self.shuffle, num_workers=self.num_workers,
                          generator=torch.Generator().manual_seed(self.seed), collate_fn=self.train_collate)  # fmt: skip
