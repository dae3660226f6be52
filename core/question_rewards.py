"""The question generator's reward (EvolvedGRPO's Q): plain functions, one per term, never raising on model output.

Q reads a row (image, problem, answer x) and answers with exactly one JSON key: ``follow_up_problem`` for a text
edit, ``edit_instruction`` for an image edit (which kind is the partition's choice,
``core.coevolution.split_image_rows``, not Q's). Its reward, after the seed (``question_generator_reward.py``)::

    reward = max(0, log(p_step) - log(max(0.2, p_answer)) + log(5))

- ``p_step``, how reliable the edit is. Text edit: the winning share of A's 5 votes on the composed problem (A is told
  x; its answers grouped by ``core.math_grading.answers_match``; the winning answer becomes the new label, TTRL-style).
  Image edit: the CLIP image-image cosine similarity of the source and the edited image (the answer is kept).
- ``p_answer``, how easy the edited sample still is: A's success rate on it (5 samples at temperature 0.7, the image
  and the edited problem only, no x), against the label; a completion without a ``\\boxed{}`` counts as wrong.

Hard gate, reward 0: Q's output is not exactly one JSON object with exactly the expected key and a non-empty string
value; an ``edit_instruction`` under 10 characters; a ``follow_up_problem`` that is only the problem again (the seed's
``normalize_agent_payload``, which its reward's ``normalize_candidate`` applies: `screen_output`); a text edit without
a consensus (no boxed answer at all, or fewer than 2 votes for the winner); an image edit
whose CLIP similarity is below 0.2. Past the gate the reward is at least 0 by construction (``p_step >= 0.2`` and
``max(0.2, p_answer) <= 1``), in [0, log 25]: highest for a reliable edit that A then always fails.

Also :func:`toy_similarity`, the toy visual-math world's stand-in for the CLIP similarity (no weights): the
intersection over union of the two images' object pixels, labelled by colour. CLIP itself, a model, is
``lightning_modules/models/clip_similarity.py`` (`ClipSimilarity`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, NamedTuple

from core.coevolution import BRIDGE, EDIT_KEYS
from core.math_grading import answers_match, extract_boxed, normalize_answer
from core.toy.grammar import COLOURS, OBJECT_COLOURS

__all__ = [
    "QuestionScore",
    "Vote",
    "answer_success_rate",
    "image_step_probability",
    "majority_vote",
    "parse_question_output",
    "question_reward",
    "score_image_edit",
    "screen_output",
    "score_text_edit",
    "text_step_probability",
    "toy_similarity",
]

VOTES = 5
"""A's samples per vote and per success rate (the seed's ``votes``)."""
MIN_AGREE = 2
"""Votes the winning answer needs (the seed's ``min_text_agreement``)."""
P_FLOOR = 0.2
"""``max(P_FLOOR, p_answer)``: the seed's ``probability_floor``, 1 / VOTES."""
MIN_CLIP = 0.2
"""Image edits below this CLIP similarity are refused (the seed's ``min_clip_similarity``)."""
MIN_INSTRUCTION_CHARS = 10
"""An ``edit_instruction`` shorter than this (stripped) is refused (the seed's ``normalize_agent_payload``)."""


# --- Q's output ------------------------------------------------------------------------------------------------------


Gate = Literal["ok", "malformed", "short_instruction", "repeats_problem", "no_consensus", "few_votes", "low_clip"]


class QuestionOutput(NamedTuple):
    key: str
    """``follow_up_problem`` or ``edit_instruction``."""
    text: str
    """Its value, stripped."""


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(keys) != len(set(keys)):
        raise ValueError("duplicate key")
    return dict(pairs)


def parse_question_output(text: Any, expected_key: str | None = None) -> QuestionOutput | None:
    """Q's output as ``(key, text)`` when it is exactly one JSON object (whitespace around it aside) with exactly one
    key, ``follow_up_problem`` or ``edit_instruction`` (``expected_key`` when given), whose value is a non-empty
    string; else None. Strict, as the seed's GRPO parser: no code fences, no prose around, no second key (a repeated
    key counts as a second one), no salvage."""
    if not isinstance(text, str):
        return None
    try:
        obj = json.loads(text.strip(), object_pairs_hook=_no_duplicates)
    except (ValueError, RecursionError):
        return None
    if not isinstance(obj, dict) or len(obj) != 1:
        return None
    ((key, value),) = obj.items()
    allowed = set(EDIT_KEYS.values()) if expected_key is None else {expected_key}
    if key not in allowed or not isinstance(value, str) or not value.strip():
        return None
    return QuestionOutput(key, value.strip())


_LABEL = re.compile(r"^(?:follow[- ]?up (?:problem|question)|new (?:problem|question))\s*:\s*", re.I)


def follow_up_of(text: str, problem: str) -> str | None:
    """The follow-up Q means, as the seed keeps it (``normalize_agent_payload``): a copy of the problem and anything
    before it dropped, then anything up to the bridge (`core.coevolution.BRIDGE`), a leading "Follow-up question:"
    label and leading ``:-`` and spaces; None when nothing is left or it is the problem itself (Q only repeated the
    problem). ``problem`` is the row's problem; its form in Q's prompt (without ``<image>``) is looked for too."""
    follow = text.strip()
    for previous in dict.fromkeys((problem.strip(), problem.replace("<image>", "").strip())):
        if previous and previous in follow:
            follow = follow.split(previous, 1)[1].strip()
            break
    if BRIDGE in follow:
        follow = follow.split(BRIDGE, 1)[1].strip()
    follow = _LABEL.sub("", follow).strip().lstrip(":- \t\r\n")
    if not follow or follow in (problem.strip(), problem.replace("<image>", "").strip()):
        return None
    return follow


def screen_output(text: Any, kind: str, problem: str | None = None) -> tuple[QuestionOutput | None, Gate]:
    """Q's output through the seed's candidate checks, in order: the JSON gate (`parse_question_output` with the
    kind's key; ``malformed``); an image edit's instruction of at least :data:`MIN_INSTRUCTION_CHARS` characters
    (``short_instruction``); a text edit's follow-up that is more than the problem again (`follow_up_of`, when
    ``problem`` is given; ``repeats_problem``). Returns the output (a follow-up as `follow_up_of` keeps it) and
    ``ok``, or None and the gate."""
    out = parse_question_output(text, EDIT_KEYS[kind])
    if out is None:
        return None, "malformed"
    if kind == "image" and len(out.text) < MIN_INSTRUCTION_CHARS:
        return None, "short_instruction"
    if kind == "text" and problem is not None:
        follow = follow_up_of(out.text, problem)
        if follow is None:
            return None, "repeats_problem"
        out = QuestionOutput(out.key, follow)
    return out, "ok"


# --- the vote (text edits) -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Vote:
    """A's votes on a composed problem."""

    answer: str | None
    """The winning answer as first written (None without any boxed answer)."""
    winning: int
    """Votes in the winning group."""
    total: int
    """Votes cast, a completion without a boxed answer included."""
    counts: list[tuple[str, int]] = field(default_factory=list)
    """Each group's first answer and size, largest first."""

    @property
    def label(self) -> str | None:
        """The new row's answer: the winner when it has at least :data:`MIN_AGREE` votes, else None."""
        return self.answer if self.answer is not None and self.winning >= MIN_AGREE else None


def majority_vote(answers: Sequence[str | None], total: int | None = None) -> Vote:
    """Group ``answers`` (A's boxed answers, None for a completion without one) by ``answers_match`` and take the
    largest group. A tie goes to the group whose first answer sorts first by its normalised text, so the winner does
    not depend on the order the samples came in. ``total`` (default ``len(answers)``) is the number of votes cast."""
    groups: list[list[str]] = []
    for a in answers:
        if a is None or not normalize_answer(a):
            continue
        for g in groups:
            if answers_match(a, g[0]):
                g.append(a)
                break
        else:
            groups.append([a])
    total = len(answers) if total is None else total
    if total < len(answers):
        raise ValueError(f"total ({total}) is smaller than the number of answers ({len(answers)})")
    groups.sort(key=lambda g: (-len(g), normalize_answer(g[0])))
    if not groups:
        return Vote(None, 0, total)
    return Vote(groups[0][0], len(groups[0]), total, [(g[0], len(g)) for g in groups])


def text_step_probability(vote: Vote) -> float | None:
    """``p_step`` of a text edit: the winning share ``winning / total``; None (gate) without a label."""
    if vote.label is None or vote.total <= 0:
        return None
    return vote.winning / vote.total


# --- image edits -----------------------------------------------------------------------------------------------------


def image_step_probability(clip_similarity: Any) -> float | None:
    """``p_step`` of an image edit: the CLIP similarity clipped to [0, 1]; None (gate) below :data:`MIN_CLIP` or when
    not a finite number."""
    try:
        s = float(clip_similarity)
    except (TypeError, ValueError):
        return None
    if not math.isfinite(s) or s < MIN_CLIP:
        return None
    return min(s, 1.0)


# --- difficulty ------------------------------------------------------------------------------------------------------


def answer_success_rate(completions: Sequence[Any], label: Any) -> float:
    """``p_answer``: the share of A's completions whose last ``\\boxed{}`` matches ``label`` (no box: wrong); 0.0
    for no completions or no label."""
    if not completions or label is None:
        return 0.0
    return sum(answers_match(extract_boxed(c), label) for c in completions) / len(completions)


# --- the reward ------------------------------------------------------------------------------------------------------


def question_reward(p_step: float | None, p_answer: float, votes: int = VOTES, floor: float = P_FLOOR) -> float:
    """``max(0, log(p_step) - log(max(floor, p_answer)) + log(votes))``; 0.0 for a gated ``p_step`` (None, not in
    (0, 1], not finite). ``p_answer`` outside [0, 1] is clipped into it."""
    if p_step is None or not isinstance(p_step, (int, float)) or not (0.0 < p_step <= 1.0):
        return 0.0
    p = float(p_answer) if isinstance(p_answer, (int, float)) and math.isfinite(p_answer) else 1.0
    p = min(max(p, 0.0), 1.0)
    return max(0.0, math.log(p_step) - math.log(max(floor, p)) + math.log(votes))


@dataclass(frozen=True)
class QuestionScore:
    """One candidate's reward and the evidence behind it (for logs and the round's lineage)."""

    reward: float
    gate: Gate
    """Why the reward is 0 (or ``ok``)."""
    p_step: float | None = None
    p_answer: float | None = None
    output: QuestionOutput | None = None
    label: str | None = None
    """The edited row's answer: the vote's winner (text) or the kept answer (image)."""

    @property
    def valid(self) -> bool:
        return self.gate == "ok"


def score_text_edit(
    q_output: Any, votes: Sequence[str | None], completions: Sequence[Any], problem: str | None = None
) -> QuestionScore:
    """A text edit's score from Q's raw output, A's boxed answers to the composed problem (x given, None for no box)
    and A's completions on the edited sample (no x). ``completions`` are graded against the vote's label. With the
    row's ``problem``, a follow-up that only repeats it is gated (`screen_output`)."""
    out, gate = screen_output(q_output, "text", problem)
    if out is None:
        return QuestionScore(0.0, gate)
    vote = majority_vote(votes)
    if vote.answer is None:
        return QuestionScore(0.0, "no_consensus", output=out)
    if vote.label is None:
        return QuestionScore(0.0, "few_votes", output=out)
    p_step = text_step_probability(vote)
    p_answer = answer_success_rate(completions, vote.label)
    return QuestionScore(question_reward(p_step, p_answer), "ok", p_step, p_answer, out, vote.label)


def score_image_edit(q_output: Any, clip_similarity: Any, completions: Sequence[Any], answer: str) -> QuestionScore:
    """An image edit's score from Q's raw output, the CLIP similarity of the source and the edited image, and A's
    completions on the edited image with the unchanged problem, graded against the kept ``answer``."""
    out, gate = screen_output(q_output, "image")
    if out is None:
        return QuestionScore(0.0, gate)
    p_step = image_step_probability(clip_similarity)
    if p_step is None:
        return QuestionScore(0.0, "low_clip", output=out)
    p_answer = answer_success_rate(completions, answer)
    return QuestionScore(question_reward(p_step, p_answer), "ok", p_step, p_answer, out, answer)


# --- the toy world's stand-in for CLIP --------------------------------------------------------------------------------


def toy_similarity(source: Any, edited: Any) -> float:
    """How much of a toy image's content an edit left where it was, in [0, 1]: the stand-in for CLIP's image-image
    similarity on the toy visual-math world (`core.toy_math`), where a random CLIP would gate nothing.

    Each pixel whose colour is exactly one of the toy's object colours (`core.toy.grammar.OBJECT_COLOURS`: the shapes
    and bars; the renderer draws them without anti-aliasing) is labelled with it; every other pixel (the background,
    noise specks, grid lines) is not. The similarity is ``|pixels with the same label in both| / |pixels labelled in
    either|``, 1.0 when neither has any. So an edit of appearance only (background, noise, grid) scores 1.0; enlarging,
    thickening or moving objects scores less the more they moved or grew (shapes 20% larger: ~0.7); recolouring or
    moving everything away from where it was scores near 0 and is gated below :data:`MIN_CLIP` like a low CLIP score.
    Images of different sizes score 0.
    """
    import numpy as np

    a = np.asarray(source.convert("RGB"), dtype=np.int32)  # [H, W, 3]
    b = np.asarray(edited.convert("RGB"), dtype=np.int32)
    if a.shape != b.shape:
        return 0.0
    palette = np.array([COLOURS[c] for c in OBJECT_COLOURS], dtype=np.int32)  # [C, 3]

    def labels(img):  # [H, W]: 1 + the object colour's index, 0 for any other colour
        packed = (img[..., 0] << 16) | (img[..., 1] << 8) | img[..., 2]
        keys = (palette[:, 0] << 16) | (palette[:, 1] << 8) | palette[:, 2]
        hit = packed[..., None] == keys  # [H, W, C]
        return np.where(hit.any(-1), hit.argmax(-1) + 1, 0)

    la, lb = labels(a), labels(b)
    union = int(((la > 0) | (lb > 0)).sum())
    return 1.0 if union == 0 else int(((la == lb) & (la > 0)).sum()) / union
