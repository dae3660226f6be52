"""Plain GRPO for grounding (Table 1's "GRPO" row, and the entropy and offline-generation baselines built on it).

Rewards: ``accuracy_weight * R_acc + format_weight * R_format`` (REC: IoU of the first box; OVD: ``s_ovd * mAP``;
the format the method's answers must follow: ``format``), all ``--model.method.init_args.*``. It also tracks the ground-truth diversity ``V(q)``
of each group and its EMA (``train/diversity/*``), so its collapse curves sit beside Syn-GRPO's, but rewards neither
and emits no evolution requests.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from core import rewards
from core.rollout import Rollout
from lightning_modules.methods.base import Method, RewardContext, RewardTerm, Scores, _flag


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
                    "needs a box; no-target queries train with --model.method CycleGRPO (as grounding groups): drop "
                    "them from --data.train_files (the toy world's train_nt / val_nt splits hold them)"
                )
        gts = [s.boxes[0] for s in ctx.samples]
        iou = rewards.rec_accuracy_reward(ctx.texts, gts, input_wh=ctx.input_wh, orig_wh=orig)
        return iou if threshold is None else [float(v >= threshold) for v in iou]
    return rewards.ovd_reward(ctx.texts, [s.boxes for s in ctx.samples], input_wh=ctx.input_wh, orig_wh=orig)


def accuracy_term(weight: float, threshold: float | None = None) -> RewardTerm:
    """The ``accuracy`` reward term of the GRPO family: ``weight`` x R_acc, binary at ``threshold`` when it is set."""
    fn = accuracy_reward if threshold is None else functools.partial(accuracy_reward, threshold=threshold)
    return RewardTerm("accuracy", weight, fn)


def format_reward(fmt: str):
    """R_format of answer format ``fmt`` (``rewards.FORMATS``) as a reward function."""

    def fn(ctx: RewardContext) -> list[float]:
        return rewards.format_reward(ctx.texts, format=fmt, parsed=ctx.parsed)

    return fn


class GRPO(Method):
    """Plain GRPO (``lightning_modules.methods.grpo.GRPO``).

    Args:
        accuracy_weight: weight of R_acc.
        accuracy_threshold: REC only. ``None`` (default): R_acc is the IoU itself (VLM-R1's). A number t in (0, 1]:
            R_acc is 1 when the IoU is >= t, else 0 (a binary outcome reward: the G completions of a group tie more
            often, the reward convergence EvolvedGRPO is about; docs/evolved_grpo.md).
        format: which parts R_format requires: ``syn_grpo`` (think, diversity, description, answer) or
            ``think_answer`` (VLM-R1's format, for the GRPO baselines).
        format_weight: weight of R_format.
        diversity_beta: EMA beta of the ground-truth diversity V(q) (Syn-GRPO's R_diversity target; the paper's best:
            0.7). GRPO only logs it (``train/diversity/*``), so its collapse curves sit beside Syn-GRPO's.
    """

    def __init__(
        self,
        accuracy_weight: float = 1.0,
        accuracy_threshold: float | None = None,
        format: str = "syn_grpo",
        format_weight: float = 1.0,
        diversity_beta: float = 0.7,
    ) -> None:
        super().__init__()
        if accuracy_threshold is not None and not 0.0 < accuracy_threshold <= 1.0:
            raise ValueError(f"{_flag('accuracy_threshold')} must be in (0, 1] or null, got {accuracy_threshold}")
        if format not in rewards.FORMATS:
            raise ValueError(f"{_flag('format')} must be one of {sorted(rewards.FORMATS)}, got {format!r}")
        self.accuracy_weight, self.accuracy_threshold = accuracy_weight, accuracy_threshold
        self.format, self.format_weight, self.diversity_beta = format, format_weight, diversity_beta
        self.smoother = rewards.DiversitySmoother(beta=diversity_beta)
        """EMA of the ground-truth diversity V(q) (Syn-GRPO's target; GRPO only logs it)."""

    def reward_terms(self) -> list[RewardTerm]:
        return [
            accuracy_term(self.accuracy_weight, self.accuracy_threshold),
            RewardTerm("format", self.format_weight, format_reward(self.format)),
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
