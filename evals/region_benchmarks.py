"""What the region benchmarks (GCG, GAR-Bench) share: an image opened with a clear error, and greedy answers to
free-text questions.

The referring-segmentation benchmarks (`benchmarks.py`) ask through `evaluator.greedy_answers`, whose questions come
from a prompt template around one query. GCG asks one fixed question per image and GAR-Bench a whole multiple-choice
block with mask-token spans in it, so `greedy_texts` renders the question as it is: one user turn, the image first,
then the text (as the released scripts' ``messages`` do), through the same rollout engines and greedy sampling.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from datamodules.gres import open_image  # re-exported: the benchmarks open their images with it
from lightning_modules.engines.base import RolloutRequest, Sampling, build_rollout_engine

__all__ = ["greedy_texts", "open_image"]


def greedy_texts(
    model, processor, images: Sequence[Any], questions: Sequence[str], *, max_new_tokens: int, engine: Any = "hf"
) -> list[str]:
    """One greedy completion of ``model`` per ``(image, question)``, the question sent verbatim after the image
    (module docstring); ``engine`` is a registered rollout engine name or instance."""
    import torch

    def prompt(question: str) -> str:
        messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": question}]}]
        return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    requests = [RolloutRequest(prompt(q), im, 1, i) for i, (im, q) in enumerate(zip(images, questions))]
    engine = build_rollout_engine(engine) if isinstance(engine, str) else engine
    with torch.no_grad():
        ro = engine.generate(model, processor, requests, Sampling(max_new_tokens=max_new_tokens, greedy=True))
    return list(ro.texts)
