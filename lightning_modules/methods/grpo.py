"""Plain GRPO for grounding (Table 1's "GRPO" row, and the entropy and offline-generation baselines built on it).

Rewards: ``accuracy_weight * R_acc + format_weight * R_format`` (REC: IoU of the first box; OVD: ``s_ovd * mAP``;
the format the method's answers must follow: ``--model.format``). It also tracks the ground-truth diversity ``V(q)``
of each group and its EMA (``train/diversity/*``), so its collapse curves sit beside Syn-GRPO's, but rewards neither
and emits no evolution requests.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from lightning_modules import rewards
from lightning_modules.methods.base import Method, RewardContext, RewardTerm, Scores
from lightning_modules.models.rollout import Rollout


def accuracy_reward(ctx: RewardContext, threshold: float | None = None) -> list[float]:
    """R_acc per row in the sample's task (REC: IoU of the first box, or ``IoU >= threshold`` as 1 / 0 when a
    threshold is given; OVD: ``s_ovd * mAP``), boxes in original pixels."""
    orig = [s.size for s in ctx.samples]
    if all(s.task == "rec" for s in ctx.samples):
        for s in ctx.samples:
            if not s.boxes:
                where = getattr(s, "source", "") or s.sample_id
                raise ValueError(
                    f"{where}: a no-target query ({s.query!r}, solution []) reached the GRPO accuracy reward, which "
                    "needs a box; no-target queries train with --model.method cycle_grpo (as grounding groups): drop "
                    "them from --data.train_files (the toy world's train_nt / val_nt splits hold them)"
                )
        gts = [s.boxes[0] for s in ctx.samples]
        iou = rewards.rec_accuracy_reward(ctx.texts, gts, input_wh=ctx.input_wh, orig_wh=orig)
        return iou if threshold is None else [float(v >= threshold) for v in iou]
    return rewards.ovd_reward(ctx.texts, [s.boxes for s in ctx.samples], input_wh=ctx.input_wh, orig_wh=orig)


def accuracy_term(hp) -> RewardTerm:
    """The ``accuracy`` reward term of the GRPO family: ``--model.accuracy_weight`` x R_acc, binary at
    ``--model.accuracy_threshold`` when it is set."""
    threshold = getattr(hp, "accuracy_threshold", None)
    fn = accuracy_reward if threshold is None else functools.partial(accuracy_reward, threshold=threshold)
    return RewardTerm("accuracy", hp.accuracy_weight, fn)


def format_reward(fmt: str):
    """R_format of answer format ``fmt`` (``rewards.FORMATS``) as a reward function."""

    def fn(ctx: RewardContext) -> list[float]:
        return rewards.format_reward(ctx.texts, format=fmt, parsed=ctx.parsed)

    return fn


class GRPO(Method):
    def __init__(self, hparams: Any) -> None:
        super().__init__(hparams)
        self.smoother = rewards.DiversitySmoother(beta=hparams.diversity_beta)
        """EMA of the ground-truth diversity V(q) (Syn-GRPO's target; GRPO only logs it)."""

    def reward_terms(self) -> list[RewardTerm]:
        return [
            accuracy_term(self.hp),
            RewardTerm("format", self.hp.format_weight, format_reward(self.hp.format)),
        ]

    def score(self, batch, ro: Rollout) -> Scores:
        scores = super().score(batch, ro)
        self.track_diversity(scores.extras, scores.parts["accuracy"], ro.group_size)
        return scores

    def track_diversity(self, extras: dict[str, Any], accuracy, group_size: int) -> None:
        """V(q) of each group [B] and its EMA V~(q) (all-reduced batch average under DDP), into ``extras`` (once per
        step: the EMA advances on the first call)."""
        if "gt_diversity" in extras:
            return
        gt = torch.as_tensor(rewards.ground_truth_diversity(accuracy, group_size))
        extras["gt_diversity"] = gt
        extras["smoothed_diversity"] = self.smoother(gt.to(self.device)).cpu()

    def train_logs(self, scores: Scores, ro: Rollout) -> dict[str, float]:
        gt, smoothed = scores.extras["gt_diversity"], scores.extras["smoothed_diversity"]
        return {
            "train/diversity/gt": float(gt.mean()),
            "train/diversity/smoothed": float(smoothed.mean()),
            "train/diversity/batch_avg": float(self.smoother.batch_avg or 0.0),
            "train/diversity/global_avg": float(self.smoother.global_avg or 0.0),
            # groups whose accuracy rewards are all equal: V(q) = 0 (the paper's diversity collapse)
            "train/diversity/zero_frac": float((gt == 0).float().mean()),
            "train/format_rate": float(scores.parts["format"].mean()),
        }

    def state_dict(self) -> dict[str, Any]:
        return {"diversity_smoother": self.smoother.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "diversity_smoother" in state:
            self.smoother.load_state_dict(state["diversity_smoother"])
