"""`StepOutput`: what a GRPO training step hands the callbacks, a typed record they read by attribute (torchtune's
``GRPOStats`` plays the same part). Built by ``step.step_output``; kept apart from ``step.py`` so that a callback
can read it without importing the step's engines and methods."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lightning_modules.methods.base import Selection

__all__ = ["STEP_KEY", "StepOutput"]

STEP_KEY = "step"
"""The key of the record in the mapping `GRPOModule.training_step` returns: Lightning accepts only a tensor, a mapping
or None from a training step and hands that mapping to ``on_train_batch_end`` as ``outputs``."""


@dataclass
class StepOutput:
    """One training step, per completion row (``N`` rows, in the rollout's order) and per sample.

    A callback gets it from Lightning's ``outputs`` with `StepOutput.of`."""

    completions: list[str]
    """[N] the completions' text."""
    boxes: list[list[list[float]]]
    """[N] each row's parsed boxes in the original image's pixels (empty for a method whose samples are not grounding
    samples, `Method.grounding`)."""
    rewards: dict[str, list[float]]
    """Reward part (``total``, ``accuracy``, ``format``, ...) -> [N] its value per row."""
    sample_index: list[int]
    """[N] the index in ``samples`` of the sample each row answers."""
    group_ids: list[int]
    """[N] each row's advantage group (`objective.Groups`)."""
    samples: list[Any]
    """The samples the rows answer: the batch's, or the versions a method re-rolled on (`Rollout.samples`)."""
    evolution: list[Selection] = field(default_factory=list)
    """The method's evolution requests (`Method.evolution`; Syn-GRPO: the selected description of each sample)."""
    extras: dict[str, Any] = field(default_factory=dict)
    """The method's own entries (`Method.step_outputs`): EvolvedGRPO's ``pool_accuracy`` ([N] the first try's accuracy
    of the pool's own versions), QuestionGenerator's ``question`` (per row its gate, scores and label)."""

    @staticmethod
    def of(outputs: Any) -> StepOutput | None:
        """The record in what Lightning hands ``on_train_batch_end`` (the mapping `GRPOModule.training_step`
        returned), or the record itself; None for another module's step (SFT's loss) or none."""
        if isinstance(outputs, StepOutput):
            return outputs
        step = outputs.get(STEP_KEY) if isinstance(outputs, Mapping) else None
        return step if isinstance(step, StepOutput) else None

    def rows_of(self, sample: int) -> list[int]:
        """The rows that answer sample ``sample`` (an index into ``samples``), in order."""
        return [i for i, b in enumerate(self.sample_index) if b == sample]
