"""Build a registered method as the module does, from one flat mapping of test settings: the `MethodContext` fields
(task, prompt template, G, ...) go to `Method.bind`, the keys the method takes to its ``__init__`` (others are
ignored, as a module's settings a method does not read), and ``args`` on top."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace
from typing import Any

import torch

from core.rollout import Rollout
from lightning_modules.methods.base import METHODS, Method, MethodContext, build_method


def build_test_method(name: str, hp: Any = None, args: dict[str, Any] | None = None) -> Method:
    hp = dict(vars(hp)) if isinstance(hp, SimpleNamespace) else dict(hp or {})
    ctx_keys = {f.name for f in fields(MethodContext)}
    ctx = MethodContext(**{k: v for k, v in hp.items() if k in ctx_keys})
    accepted = set(build_method(name).config()["init_args"]) if name in METHODS else set()
    own = {k: v for k, v in hp.items() if k in accepted}
    return build_method({"class_path": name, "init_args": {**own, **(args or {})}}).bind(ctx)


def text_rollout(texts: list[str], group_size: int, wh: tuple[int, int] = (100, 100)) -> Rollout:
    """A `Rollout` of ``texts`` only (one-token prompts and completions, no image): what a method's rewards read."""
    n = len(texts)
    z = torch.zeros(n, 1, dtype=torch.long)
    return Rollout(
        prompt_ids=z,
        prompt_mask=z + 1,
        completion_ids=z,
        completion_mask=z + 1,
        pixel_values=torch.zeros(0, 1),
        image_grid_thw=torch.zeros(n, 3, dtype=torch.long),
        texts=texts,
        input_wh=[wh] * n,
        group_size=group_size,
        group_ids=torch.arange(n) // group_size,
    )
