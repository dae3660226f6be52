"""The GRPO loop: `GRPOModule` (``module.py``: the policy and reference, the step, evaluation, checkpointed state), its
settings in typed groups (``args.py``), the Lightning-free parts of its step (``step.py``: the policy view a method
gets, phase timing, the micro-batches' loss, the step's logs and outputs), the typed record callbacks read
(``outputs.py``: `StepOutput`) and the trainer checks (``checks.py``). Configs name the module as
``lightning_modules.grpo.GRPOModule``; it is imported on first use, so that ``args.py`` and ``step.py`` can be imported
without the module (and the package never imports back into itself)."""

from __future__ import annotations

import importlib
from typing import Any

__all__ = ["GRPOModule"]


def __getattr__(name: str) -> Any:
    if name == "GRPOModule":
        return importlib.import_module("lightning_modules.grpo.module").GRPOModule
    raise AttributeError(f"module 'lightning_modules.grpo' has no attribute {name!r}")
