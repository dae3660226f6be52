"""The answer model's prompt (EvolvedGRPO's co-evolution): the seed's EasyR1 math format prompt.

Shared by the reasoning rows (``datamodules/reasoning.py``: a row's prompt), the answer model's method and the question
generator (``lightning_modules/methods/``) and the SFT stage, so it lives in the low layer.
"""

from __future__ import annotations

__all__ = ["ANSWER_FORMAT", "answer_prompt"]

ANSWER_FORMAT = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    "The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}."
)
"""The seed's format instruction for the answer model (appended to the problem)."""


def answer_prompt(problem: str) -> str:
    """The answer model's user text (the image is shown before it): the problem, a space, and :data:`ANSWER_FORMAT`.

    As the seed builds it (EasyR1's ``RLHFDataset._build_messages`` with ``math_format.jinja``): the problem is
    trimmed, and a leading ``<image>`` becomes the image, the text after it kept as it is ("<image>\\nIn the figure"
    reads "\\nIn the figure" after the image). Any other ``<image>`` is removed (the seed would show the image there;
    here it always comes first)."""
    text = problem.strip()
    if text.startswith("<image>"):
        text = text[len("<image>") :]
    elif "<image>" in text:
        text = text.replace("<image>", "").strip()
    return f"{text.replace('<image>', '')} {ANSWER_FORMAT}"
