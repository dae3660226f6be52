"""The parts of a GRPO step that need no Lightning: timing its phases, the loss of one micro-batch, its ``train/*``
logs, and what it hands the callbacks. `GRPOModule.training_step` (``module.py``) strings them together; the math is
``objective.py``'s.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from lightning_modules import objective, rewards
from lightning_modules.methods.base import Method, Scores, Selection
from lightning_modules.models.rollout import Rollout

__all__ = ["PhaseTimer", "micro_batch_loss", "step_output", "train_logs"]


class PhaseTimer:
    """Wall time of a step's phases (rollout, rewards, reference, update, optimizer), logged as ``train/time/*_s``.

    On CUDA each lap synchronizes, so a phase is charged for the kernels it queued (five host syncs per step)."""

    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self.times: dict[str, float] = {}
        self._t = self._now()

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize()
        return time.perf_counter()

    def lap(self, name: str) -> None:
        now = self._now()
        self.times[name] = self.times.get(name, 0.0) + now - self._t
        self._t = now


def micro_batch_loss(hp, logp, ent, rows, *, adv, mask, old_logp, ref_logp) -> tuple[torch.Tensor, dict[str, Any]]:
    """The clipped surrogate (+ KL, + the entropy baselines) of rows ``rows``, aggregated over them.

    ``hp``: the module's hyperparameters; ``logp`` / ``ent`` [n, T]: the rows' log-probs and entropies; ``adv`` [N],
    ``mask`` [N, T], ``old_logp`` / ``ref_logp`` [N, T] (or None): the whole step's, indexed by ``rows``."""
    m = mask[rows]
    a = adv[rows]
    if hp.entropy_adv_coef > 0:
        # token-level shaping [n, T]: A + min(alpha * H_t, |A| / kappa), entropy detached (a bonus, not a loss)
        a = a[:, None] + torch.minimum(hp.entropy_adv_coef * ent.detach(), a.abs()[:, None] / hp.entropy_adv_kappa)
    old = old_logp[rows] if old_logp is not None else logp.detach()
    loss, stats = objective.policy_loss(
        logp,
        old,
        a,
        m,
        clip_low=hp.clip_low,
        clip_high=hp.clip_high,
        dual_clip=hp.dual_clip,
        ref_logp=ref_logp[rows] if ref_logp is not None else None,
        kl_coef=hp.kl_coef,
        kl_estimator=hp.kl_estimator,
        aggregation=hp.aggregation,
        max_length=hp.max_new_tokens,
    )
    if hp.entropy_coef > 0:  # "GRPO + Entropy Loss": maximise the mean token entropy
        loss = loss - hp.entropy_coef * objective.aggregate(ent, m, hp.aggregation, hp.max_new_tokens)
    return loss, stats


def train_logs(
    method: Method,
    task: str,
    scores: Scores,
    ro: Rollout,
    stats: dict[str, float],
    entropy: torch.Tensor,
    device: torch.device,
) -> dict[str, float]:
    """The step's ``train/*`` values: reward parts and their spread, entropy, zero-variance groups, completion length,
    the method's own values, the CUDA peak memory (then reset for the next step), REC accuracy and which way tied
    groups went, and the loss statistics ``stats``."""
    parts = scores.parts
    # groups whose total rewards are all equal: zero advantage, no policy-gradient signal
    std, zero_var = objective.group_reward_stats(parts["total"], ro.group_ids)
    logs = {f"train/reward/{k}": float(v.mean()) for k, v in parts.items()}
    logs.update(
        {
            "train/reward/std": std,
            "train/entropy": float(entropy),
            "train/zero_variance_frac": zero_var,
            "train/completion_length": float(ro.completion_mask.sum(1).float().mean()),
        }
    )
    logs.update(method.train_logs(scores, ro))
    if torch.cuda.is_available() and device.type == "cuda":  # the step's peak, then reset for the next
        logs["train/peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        torch.cuda.reset_peak_memory_stats(device)
    acc = parts.get("accuracy")
    if acc is not None and task == "rec":
        logs["train/iou"] = float(acc.mean())
        logs["train/acc50"] = float((acc >= 0.5).float().mean())
        # which way tied groups go: every answer right (IoU >= 0.5), every answer wrong
        logs["train/all_correct_frac"], logs["train/all_wrong_frac"] = objective.group_convergence(
            acc, ro.group_ids, 0.5
        )
    for k, v in stats.items():
        logs[f"train/{k}"] = v
    return logs


def step_output(method: Method, batch, ro: Rollout, scores: Scores, evolution: list[Selection]) -> dict:
    """What ``on_train_batch_end`` callbacks receive: per completion row its text, its parsed boxes in original
    pixels, its reward parts, the index of its sample in the batch and its advantage group; the samples the rows
    answer (``samples``: the batch's, or the versions a method re-rolled on); the method's evolution requests and
    its own entries (`Method.step_outputs`)."""
    index = method.sample_index(batch, ro)
    boxes = [
        [rewards.rescale_box(b, in_wh, batch[i].size) for b in p.boxes]
        for p, in_wh, i in zip(scores.parsed, ro.input_wh, index)
    ]
    return {
        "completions": list(ro.texts),
        "boxes": boxes,
        "rewards": {k: [float(v) for v in t] for k, t in scores.parts.items()},
        "group_size": ro.group_size,
        "sample_index": index,
        "group_ids": ro.group_ids.tolist(),
        "evolution": evolution,
        "samples": list(batch),
        **method.step_outputs(batch, ro, scores),
    }
