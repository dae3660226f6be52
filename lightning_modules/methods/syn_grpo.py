"""Syn-GRPO: GRPO whose completions also predict a diversity score and describe a new background for the image.

Rewards: ``R_acc + R_format + R_diversity`` (weights ``accuracy_weight`` / ``format_weight`` / ``diversity_weight``,
all ``--model.method.init_args.*``). ``R_diversity`` compares each completion's predicted diversity with the
EMA-smoothed ground-truth diversity ``V~(q)`` of its group (``rewards.DiversitySmoother``, ``diversity_beta``); the form
of the comparison is a named choice (``diversity_reward_form``; docs/diversity_reward.md).

Evolution: per sample, the description of the completion with the highest ``R_diversity`` among those whose
description parses (``description_selection: diversity``; ``random`` is the "w/o R_div" ablation, ``none`` emits
nothing); the synthesis callback sends them to the data server.
"""

from __future__ import annotations

import random
from typing import Any, Literal

from core import rewards
from core.rollout import Rollout
from lightning_modules.methods.base import RewardContext, RewardTerm, Scores, Selection, _flag
from lightning_modules.methods.grpo import GRPO


class SynGRPO(GRPO):
    """Syn-GRPO (``lightning_modules.methods.syn_grpo.SynGRPO``): GRPO's arguments, and

    Args:
        diversity_weight: weight of R_diversity (0: GRPO's rewards, with Syn-GRPO's selection and evolution).
        diversity_reward_form: named form of R_diversity (``rewards.DIVERSITY_REWARD_FORMS``; docs/diversity_reward.md).
        description_selection: ``diversity`` (argmax R_diversity), ``random`` (the w/o R_div ablation) or ``none``.
        selection_seed: seed of the ``random`` selection.
    """

    def __init__(
        self,
        diversity_weight: float = 1.0,
        diversity_reward_form: str = "linear",
        description_selection: Literal["diversity", "random", "none"] = "diversity",
        selection_seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if diversity_reward_form not in rewards.DIVERSITY_REWARD_FORMS:
            raise ValueError(
                f"{_flag('diversity_reward_form')} must be one of {sorted(rewards.DIVERSITY_REWARD_FORMS)}, "
                f"got {diversity_reward_form!r}"
            )
        if description_selection not in ("diversity", "random", "none"):
            raise ValueError(
                f"{_flag('description_selection')} must be 'diversity', 'random' or 'none', got {description_selection!r}"
            )
        self.diversity_weight, self.diversity_reward_form = diversity_weight, diversity_reward_form
        self.description_selection = description_selection
        self.rng = random.Random(selection_seed)
        """Draws of the ``random`` selection (checkpointed)."""

    def diversity_reward(self, ctx: RewardContext) -> list[float]:
        """R_diversity: the predicted diversity against V~(q) of the row's group (needs ``accuracy`` first)."""
        self.track_diversity(ctx.extras, ctx.parts["accuracy"], ctx.group_size)
        target = ctx.extras["smoothed_diversity"].repeat_interleave(ctx.group_size).tolist()
        return rewards.diversity_reward([p.diversity for p in ctx.parsed], target, form=self.diversity_reward_form)

    def reward_terms(self) -> list[RewardTerm]:
        return [
            *super().reward_terms(),
            RewardTerm("diversity", self.diversity_weight, self.diversity_reward),
        ]

    def evolution(self, batch, ro: Rollout, scores: Scores, *, step: int, epoch: int) -> list[Selection]:
        mode = self.description_selection
        if mode == "none":
            return []
        G, parsed, div = ro.group_size, scores.parsed, scores.parts["diversity"]
        out = []
        for b, sample in enumerate(batch):
            rows = [b * G + i for i in range(G) if parsed[b * G + i].description]
            if not rows:
                continue
            best = max(rows, key=lambda r: (float(div[r]), -r)) if mode == "diversity" else self.rng.choice(rows)
            out.append(
                Selection(
                    sample_id=sample.sample_id,
                    description=parsed[best].description,
                    index=best - b * G,
                    diversity_reward=float(div[best]),
                    predicted_diversity=parsed[best].diversity,
                    gt_diversity=float(scores.extras["gt_diversity"][b]),
                    smoothed_diversity=float(scores.extras["smoothed_diversity"][b]),
                    step=step,
                    epoch=epoch,
                )
            )
        return out

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "selection_rng": self.rng.getstate()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if "selection_rng" in state:
            s = state["selection_rng"]
            self.rng.setstate((s[0], tuple(s[1]), s[2]))
