"""The toy visual-math world, EvolvedGRPO's embedded default for reasoning data: procedural scenes with countable or
measurable content (``world``: coloured shapes, bar charts), problems with exact answers, and follow-ups in terms of
the previous answer whose answers stay exact (``follow_up``). ``datamodules.toy_math`` draws the splits and writes
them as ``{id, image, problem, answer}`` rows."""

from core.toy_math.follow_up import FollowUp, ToyProblem, exact_answer, follow_up, parse_follow_up, random_follow_up
from core.toy_math.world import KINDS, evaluate, make_query, make_scene, question, render

__all__ = [
    "KINDS",
    "FollowUp",
    "ToyProblem",
    "evaluate",
    "exact_answer",
    "follow_up",
    "make_query",
    "make_scene",
    "parse_follow_up",
    "question",
    "random_follow_up",
    "render",
]
