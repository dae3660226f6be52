"""The parts of a GRPO step that need no Lightning: the view of the policy a method gets (`PolicyHost`), timing the
step's phases, the loss of its micro-batches (`StepLoss`, which the update engine calls), its ``train/*`` logs, and
what it hands the callbacks (`outputs.StepOutput`). `GRPOModule.training_step` (``module.py``) strings them together; the math is
``objective.py``'s.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from core import objective, rewards
from core.rollout import Rollout
from lightning_modules.engines.base import RolloutEngine, RolloutRequest, Sampling
from lightning_modules.grpo.args import KLArgs, OptimArgs
from lightning_modules.grpo.outputs import StepOutput
from lightning_modules.methods.base import Method, Scores, Selection
from lightning_modules.models import fsdp

__all__ = ["PhaseTimer", "PolicyHost", "StepLoss", "micro_batch_loss", "step_output", "train_logs"]


@dataclass
class PolicyHost:
    """What a method sees of the module that runs it (`methods.base.MethodHost`): the policy, its processor and rollout
    engine, the device and step, and `generate`. Built by the module for each call into the method, so a method never
    holds (or calls back into) the training loop."""

    policy: nn.Module
    processor: Any
    rollout_engine: RolloutEngine
    device: torch.device
    global_step: int
    sampling: Sampling
    """The module's training sampling (`generate`'s default)."""
    gather_layers: bool | None
    """Under FSDP2, how a rollout gathers the sharded policy (``True``: whole, ``False``: its root unit only); None
    when the policy is not sharded."""
    rec_predictions: Callable[[Sequence[Any]], list[dict]]
    """The module's REC / OVD prediction records of a batch (``train.py predict``)."""

    def gathered(self):
        """The policy's parameters gathered for a rollout (nothing to do unless it is sharded)."""
        if self.gather_layers is None:
            return contextlib.nullcontext()
        return fsdp.gathered(self.policy, layers=self.gather_layers, release=self.rollout_engine.release)

    def generate(self, requests: Sequence[RolloutRequest], sampling: Sampling | None = None) -> Rollout:
        """Completions of the policy for rollout requests, through the module's rollout engine."""
        with self.gathered():
            return self.rollout_engine.generate(self.policy, self.processor, requests, sampling or self.sampling)


class StepLoss:
    """The loss of a step's micro-batches, as the update engine asks for it: ``loss(logp, ent, rows)`` is the share of
    rows ``rows`` of the full-batch loss, weighted by the step's `objective.LossCount` (``count``, computed once per
    step) so the accumulated gradient equals the full-batch aggregation. The first iteration also accumulates this
    rank's logged statistics (``stats``) and its entropy sum."""

    def __init__(
        self,
        optim: OptimArgs,
        kl: KLArgs,
        max_length: int,
        *,
        adv: torch.Tensor,
        mask: torch.Tensor,
        count: objective.LossCount,
        old_logp: torch.Tensor | None,
        ref_logp: torch.Tensor | None,
        row_weights: torch.Tensor | None = None,
    ):
        self.optim, self.kl, self.max_length = optim, kl, max_length
        self.adv, self.mask, self.count, self.old_logp, self.ref_logp = adv, mask, count, old_logp, ref_logp
        self.row_weights = row_weights  # [N] or None (`Method.loss_sides`)
        self.first = True
        self.stats: dict[str, float] = {}
        self.entropy_sum = torch.zeros((), dtype=torch.float32, device=mask.device)

    def __call__(self, logp: torch.Tensor, ent: torch.Tensor, rows) -> torch.Tensor:
        loss, stats = micro_batch_loss(
            self.optim, self.kl, self.max_length, logp, ent, rows,
            adv=self.adv, mask=self.mask, old_logp=self.old_logp, ref_logp=self.ref_logp, row_weights=self.row_weights,
        )  # fmt: skip
        share = self.count.share(rows)
        if self.first:  # the logged stats are this rank's aggregation
            local = float(share / self.count.local)
            for k, v in stats.items():
                self.stats[k] = self.stats.get(k, 0.0) + float(v) * local
            self.entropy_sum = self.entropy_sum + (ent.detach() * self.mask[rows]).sum()
        return loss * (share / self.count.denom)

    def entropy(self) -> torch.Tensor:
        """The mean token entropy of the rollout (this rank's)."""
        return self.entropy_sum / self.mask.sum().clamp(min=1)


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


def micro_batch_loss(
    o: OptimArgs, kl: KLArgs, max_length: int, logp, ent, rows, *, adv, mask, old_logp, ref_logp, row_weights=None
) -> tuple[torch.Tensor, dict[str, Any]]:
    """The clipped surrogate (+ KL, + the entropy baselines) of rows ``rows``, aggregated over them.

    ``o`` / ``kl``: the module's optimisation and KL settings; ``max_length``: ``sampling.max_new_tokens`` (Dr. GRPO's
    normaliser); ``logp`` / ``ent`` [n, T]: the rows' log-probs and entropies; ``adv`` [N], ``mask`` [N, T],
    ``old_logp`` / ``ref_logp`` [N, T] (or None), ``row_weights`` [N] (or None): the whole step's, indexed by
    ``rows``."""
    m = mask[rows]
    a = adv[rows]
    if o.entropy_adv_coef > 0:
        # token-level shaping [n, T]: A + min(alpha * H_t, |A| / kappa), entropy detached (a bonus, not a loss)
        a = a[:, None] + torch.minimum(o.entropy_adv_coef * ent.detach(), a.abs()[:, None] / o.entropy_adv_kappa)
    old = old_logp[rows] if old_logp is not None else logp.detach()
    loss, stats = objective.policy_loss(
        logp,
        old,
        a,
        m,
        clip_low=o.clip_low,
        clip_high=o.clip_high,
        dual_clip=o.dual_clip,
        ref_logp=ref_logp[rows] if ref_logp is not None else None,
        kl_coef=kl.coef,
        kl_estimator=kl.estimator,
        aggregation=o.aggregation,
        max_length=max_length,
        row_weights=row_weights[rows] if row_weights is not None else None,
    )
    if o.entropy_coef > 0:  # "GRPO + Entropy Loss": maximise the mean token entropy
        e = ent if row_weights is None else ent * row_weights[rows][:, None]
        loss = loss - o.entropy_coef * objective.aggregate(e, m, o.aggregation, max_length)
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
    if acc is not None and task == "rec" and method.grounding:
        logs["train/iou"] = float(acc.mean())
        logs["train/acc50"] = float((acc >= 0.5).float().mean())
        # which way tied groups go: every answer right (IoU >= 0.5), every answer wrong
        logs["train/all_correct_frac"], logs["train/all_wrong_frac"] = objective.group_convergence(
            acc, ro.group_ids, 0.5
        )
    for k, v in stats.items():
        logs[f"train/{k}"] = v
    return logs


def step_output(method: Method, batch, ro: Rollout, scores: Scores, evolution: list[Selection]) -> StepOutput:
    """What ``on_train_batch_end`` callbacks receive (`StepOutput`): per completion row its text, its parsed boxes in
    original pixels, its reward parts, its sample and its advantage group; the samples the rows answer; the method's
    evolution requests and its own entries (`Method.step_outputs`)."""
    index = method.sample_index(batch, ro)
    boxes = [
        [rewards.rescale_box(b, in_wh, batch[i].size) for b in p.boxes] if method.grounding else []
        for p, in_wh, i in zip(scores.parsed, ro.input_wh, index)
    ]
    return StepOutput(
        completions=list(ro.texts),
        boxes=boxes,
        rewards={k: [float(v) for v in t] for k, t in scores.parts.items()},
        sample_index=index,
        group_ids=ro.group_ids.tolist(),
        samples=list(batch),
        evolution=evolution,
        extras=method.step_outputs(batch, ro, scores),
    )
