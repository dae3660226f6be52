"""GRPO-family methods as plug-ins of `GRPOModule` (``methods.base``), registered by name (``--model.method``)."""

from lightning_modules.methods import cycle_grpo, evolved_grpo, grpo, syn_grpo  # noqa: F401 - registers the built-in methods
from lightning_modules.methods.base import (
    METHODS,
    Method,
    RewardContext,
    RewardTerm,
    Scores,
    Selection,
    build_method,
    register_method,
)

__all__ = ["METHODS", "Method", "RewardContext", "RewardTerm", "Scores", "Selection", "build_method", "register_method"]
