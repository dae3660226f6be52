"""Syn-GRPO: GRPO whose completions also predict a diversity score and describe a new background for the image.

Rewards: ``R_acc + R_format + R_diversity`` (weights ``--model.accuracy_weight`` / ``format_weight`` /
``diversity_weight``). ``R_diversity`` compares each completion's predicted diversity with the EMA-smoothed
ground-truth diversity ``V~(q)`` of its group (``rewards.DiversitySmoother``, ``--model.diversity_beta``); the form of
the comparison is a named choice (``--model.diversity_reward_form``; docs/diversity_reward.md).

Evolution: per sample, the description of the completion with the highest ``R_diversity`` among those whose
description parses (``--model.description_selection diversity``; ``random`` is the "w/o R_div" ablation, ``none``
emits nothing); the synthesis callback sends them to the data server.
"""

from __future__ import annotations

import random
from typing import Any

from lightning_modules import rewards
from lightning_modules.methods.base import RewardContext, RewardTerm, Scores, Selection
from lightning_modules.methods.grpo import GRPO, accuracy_term, format_reward
from lightning_modules.models.rollout import Rollout


class SynGRPO(GRPO):
    def __init__(self, hparams: Any) -> None:
        super().__init__(hparams)
        self.rng = random.Random(hparams.seed)
        """Draws of the ``random`` selection (checkpointed)."""

    def diversity_reward(self, ctx: RewardContext) -> list[float]:
        """R_diversity: the predicted diversity against V~(q) of the row's group (needs ``accuracy`` first)."""
        self.track_diversity(ctx.extras, ctx.parts["accuracy"], ctx.group_size)
        target = ctx.extras["smoothed_diversity"].repeat_interleave(ctx.group_size).tolist()
        return rewards.diversity_reward([p.diversity for p in ctx.parsed], target, form=self.hp.diversity_reward_form)

    def reward_terms(self) -> list[RewardTerm]:
        return [
            accuracy_term(self.hp),
            RewardTerm("format", self.hp.format_weight, format_reward(self.hp.format)),
            RewardTerm("diversity", self.hp.diversity_weight, self.diversity_reward),
        ]

    def evolution(self, batch, ro: Rollout, scores: Scores, *, step: int, epoch: int) -> list[Selection]:
        mode = self.hp.description_selection
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
