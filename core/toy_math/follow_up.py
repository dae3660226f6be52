"""Follow-ups on the toy visual-math world: a problem with answer x becomes the old problem + "Let x be the answer
to the preceding problem ..." + a question in terms of x (``core.coevolution.compose_follow_up``, the seed's composed
form), and its exact answer is the follow-up applied to the old problem's exact answer, so every composed problem
stays checkable against its scene, however many rounds deep.

The follow-ups are functions of x alone (the seed asks Q for no new visual dependency), with integer results:

=========  ==========================  =========
op         text                        value
=========  ==========================  =========
``add``    What is x + k?              x + k
``sub``    What is x - k?              x - k
``mul``    What is k times x?          k * x
``rsub``   What is k - x?              k - x
``square`` What is x squared?          x * x
=========  ==========================  =========

:func:`parse_follow_up` reads these texts back (and the common ways of writing them: ``x+3``, ``3x``, ``3*x``,
``x^2``), so a question generator's free-text follow-up that falls in this grammar gets an exact label too.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from core.coevolution import compose_follow_up
from core.toy_math.world import evaluate, question

__all__ = ["FOLLOW_OPS", "FollowUp", "ToyProblem", "exact_answer", "follow_up", "parse_follow_up", "random_follow_up"]

FOLLOW_OPS = ("add", "sub", "mul", "rsub", "square")


@dataclass(frozen=True)
class FollowUp:
    """One follow-up in terms of x."""

    op: str
    """One of :data:`FOLLOW_OPS`."""
    k: int = 0
    """The constant (unused by ``square``)."""

    def __post_init__(self) -> None:
        if self.op not in FOLLOW_OPS:
            raise ValueError(f"follow-up op must be one of {FOLLOW_OPS}, got {self.op!r}")

    def text(self) -> str:
        return {
            "add": f"What is x + {self.k}?",
            "sub": f"What is x - {self.k}?",
            "mul": f"What is {self.k} times x?",
            "rsub": f"What is {self.k} - x?",
            "square": "What is x squared?",
        }[self.op]

    def apply(self, x: int) -> int:
        return {
            "add": x + self.k,
            "sub": x - self.k,
            "mul": self.k * x,
            "rsub": self.k - x,
            "square": x * x,
        }[self.op]

    def to_dict(self) -> dict[str, Any]:
        return {"op": self.op, "k": self.k}


_INT = r"(\d{1,4})"
_PATTERNS = [
    (re.compile(rf"^x\s*\+\s*{_INT}$"), "add"),
    (re.compile(rf"^{_INT}\s*\+\s*x$"), "add"),
    (re.compile(rf"^x\s*-\s*{_INT}$"), "sub"),
    (re.compile(rf"^{_INT}\s*(?:\*|times|×|\\times|\\cdot)?\s*x$"), "mul"),
    (re.compile(rf"^x\s*(?:\*|times|×|\\times|\\cdot)\s*{_INT}$"), "mul"),
    (re.compile(rf"^{_INT}\s*-\s*x$"), "rsub"),
    (re.compile(r"^(?:x\s*(?:squared|\^\s*2|\*\*\s*2|\*\s*x)|the square of x)$"), "square"),
]


def parse_follow_up(text: Any) -> FollowUp | None:
    """The follow-up a text asks for, when it is one of the toy grammar's ("What is x + 3?", "Compute 3x.",
    "x^2"); None otherwise (never raises)."""
    if not isinstance(text, str) or len(text) > 200:
        return None
    s = text.strip().lower().rstrip("?.! ").strip()
    s = re.sub(r"^(?:what is|what's|compute|calculate|find|evaluate)\s+(?:the value of\s+)?", "", s).strip()
    s = s.strip("$ ").strip()
    for pattern, op in _PATTERNS:
        m = pattern.match(s)
        if m:
            return FollowUp(op, int(m.group(1)) if m.groups() and m.group(1) else 0)
    return None


def random_follow_up(rng: np.random.Generator) -> FollowUp:
    """A follow-up drawn uniformly over :data:`FOLLOW_OPS`, constants 1-9 (``mul``: 2-5; ``rsub``: 10-20)."""
    op = FOLLOW_OPS[int(rng.integers(len(FOLLOW_OPS)))]
    k = {"add": (1, 9), "sub": (1, 9), "mul": (2, 5), "rsub": (10, 20), "square": (0, 0)}[op]
    return FollowUp(op, int(rng.integers(k[0], k[1] + 1)))


@dataclass(frozen=True)
class ToyProblem:
    """A toy problem: the base query on the scene, the follow-ups composed onto it, its text and exact answer."""

    query: dict[str, Any]
    text: str
    answer: int | str
    follow_ups: tuple[FollowUp, ...] = field(default_factory=tuple)

    @classmethod
    def base(cls, scene: dict[str, Any], query: dict[str, Any]) -> ToyProblem:
        return cls(query, question(query), evaluate(scene, query))

    def to_meta(self) -> dict[str, Any]:
        return {"query": self.query, "follow_ups": [f.to_dict() for f in self.follow_ups]}


def follow_up(problem: ToyProblem, op: FollowUp | str) -> ToyProblem:
    """``problem`` with answer x, followed up by ``op`` (a :class:`FollowUp`, or a follow-up text in the toy grammar):
    the composed text and the exact answer ``op(x)``. Raises ValueError for a choice-letter answer (no number to
    follow up) or a text outside the grammar."""
    if isinstance(op, str):
        parsed = parse_follow_up(op)
        if parsed is None:
            raise ValueError(f"not a toy follow-up: {op!r}")
        op = parsed
    if not isinstance(problem.answer, int):
        raise ValueError(f"only a numeric answer can be followed up, got {problem.answer!r}")
    return ToyProblem(
        problem.query,
        compose_follow_up(problem.text, op.text()),
        op.apply(problem.answer),
        problem.follow_ups + (op,),
    )


def exact_answer(scene: dict[str, Any], problem_meta: dict[str, Any]) -> int | str:
    """A problem's answer recomputed from its scene alone: the base query evaluated, then each follow-up applied."""
    value = evaluate(scene, problem_meta["query"])
    for f in problem_meta.get("follow_ups", []):
        value = FollowUp(f["op"], int(f.get("k", 0))).apply(value)
    return value
