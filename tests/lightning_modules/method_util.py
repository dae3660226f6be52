"""Build a registered method as the module does, from one flat mapping of test settings: the `MethodContext` fields
(task, prompt template, G, ...) go to `Method.bind`, the keys the method takes to its ``__init__`` (others are
ignored, as a module's settings a method does not read), and ``args`` on top."""

from __future__ import annotations

from dataclasses import fields
from types import SimpleNamespace
from typing import Any

from lightning_modules.methods.base import METHODS, Method, MethodContext, build_method


def build_test_method(name: str, hp: Any = None, args: dict[str, Any] | None = None) -> Method:
    hp = dict(vars(hp)) if isinstance(hp, SimpleNamespace) else dict(hp or {})
    ctx_keys = {f.name for f in fields(MethodContext)}
    ctx = MethodContext(**{k: v for k, v in hp.items() if k in ctx_keys})
    accepted = set(build_method(name).config()["init_args"]) if name in METHODS else set()
    own = {k: v for k, v in hp.items() if k in accepted}
    return build_method({"class_path": name, "init_args": {**own, **(args or {})}}).bind(ctx)
