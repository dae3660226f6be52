"""EvolvedGRPO: GRPO with a prefix-style process reward on multi-step questions, trained on instruction-evolved data.

Rewards: ``R_acc + R_format + process_weight * R_process`` (docs/evolved_grpo.md). ``R_process`` is the prefix
credit of a completion's ``<step>[box]</step>`` parts (inside ``<think>``, before the answer) against the gold chain of
its question (``datamodules.evolve.query_steps``: anchor first, target last): the fraction of steps in the longest
correct prefix (IoU >= ``step_iou``, in order). A one-step question, or a sample that is no toy scene, has no chain
and earns 0 from every completion, so the term leaves its group's advantages alone. GRPO's group normalisation runs
on the sum as usual: where the outcomes tie (all wrong, typically) the process term still ranks the completions that
found the anchor above those that did not, which is what the paper's combination of process and group-relative
outcome rewards buys; ``process_weight: 0`` is GRPO.

The data side (the per-sample level, harder edits for solved groups, sub-problems for failed ones) is the
``instruction_evolution`` strategy of the synthesis callback; this method reads the level each sample's version
carries (``meta["level"]``) to log ``train/level/*``, and logs the outcome's zero-variance fraction
(``train/level/outcome_zero_var_frac``: groups whose accuracy rewards are all equal, the paper's reward convergence).
"""

from __future__ import annotations

from typing import Any

import torch

from datamodules import evolve
from lightning_modules import objective
from lightning_modules.methods.base import RewardContext, RewardTerm, Scores, register_method
from lightning_modules.methods.grpo import GRPO
from lightning_modules.methods.syn_grpo import SynGRPO
from lightning_modules.policy import Rollout


class ProcessReward:
    """EvolvedGRPO's part of a method, mixed in before a GRPO-family base: the process reward term, the level logs.
    Args (``--model.method_args``): ``process_weight`` (>= 0; weight of R_process in the total), ``step_iou`` (IoU a
    step's box needs to count as correct)."""

    def __init__(self, hparams: Any, process_weight: float = 0.5, step_iou: float = 0.5) -> None:
        super().__init__(hparams)
        if process_weight < 0:
            raise ValueError(f"--model.method_args.process_weight must be >= 0, got {process_weight}")
        if not 0.0 < step_iou <= 1.0:
            raise ValueError(f"--model.method_args.step_iou must be in (0, 1], got {step_iou}")
        self.process_weight, self.step_iou = process_weight, step_iou

    def process_reward(self, ctx: RewardContext) -> list[float]:
        """R_process per row: prefix credit of its steps against its question's gold chain (0 without a chain)."""
        chains: dict[int, list[list[int]]] = {}
        out = []
        for s, text, iw in zip(ctx.samples, ctx.texts, ctx.input_wh):
            key = id(s)
            if key not in chains:
                steps = evolve.query_steps(s.meta or {}, s.query) if s.task == "rec" else []
                chains[key] = [st.box for st in steps] if len(steps) >= 2 else []
            gold = chains[key]
            if not gold:
                out.append(0.0)
                continue
            out += evolve.prefix_process_reward(
                [text], [gold], input_wh=iw, orig_wh=s.size, iou_threshold=self.step_iou
            )
        ctx.extras["multi_step"] = torch.tensor([bool(chains[id(s)]) for s in ctx.samples])
        return out

    def reward_terms(self) -> list[RewardTerm]:
        return super().reward_terms() + [RewardTerm("process", self.process_weight, self.process_reward)]

    def score(self, batch, ro: Rollout) -> Scores:
        scores = super().score(batch, ro)
        scores.extras["level_logs"] = level_stats(list(batch))
        scores.extras["version_depth"] = [evolve.version_depth(s.meta or {}, s.query) for s in batch]
        return scores

    def train_logs(self, scores: Scores, ro: Rollout) -> dict[str, float]:
        logs = super().train_logs(scores, ro)
        multi = scores.extras["multi_step"][:: ro.group_size].float()
        _, zero_var = objective.group_reward_stats(scores.parts["accuracy"], ro.group_ids)
        logs.update(
            {
                "train/level/outcome_zero_var_frac": float(zero_var),
                "train/level/multi_step_frac": float(multi.mean()),
                # the process reward where it applies: how much of the chain the completions got right
                "train/level/prefix_credit": float(scores.parts["process"][scores.extras["multi_step"]].mean())
                if bool(multi.any())
                else 0.0,
            }
        )
        logs.update(scores.extras["level_logs"])
        logs.update(ties_by_version(scores.parts["accuracy"], scores.extras["version_depth"]))
        return logs


@register_method("evolved_grpo")
class EvolvedGRPO(ProcessReward, GRPO):
    """GRPO's accuracy and format rewards plus the prefix process reward (the module docstring)."""


@register_method("evolved_syn_grpo")
class EvolvedSynGRPO(ProcessReward, SynGRPO):
    """Syn-GRPO (diversity reward, descriptions for the data server) plus the prefix process reward: the method of
    ``configs/overlays/evolved_syn.yaml``, where instruction evolution and Syn-GRPO's image evolution share one pool."""


VERSIONS = ("question", "sub", "easier")
"""The names of ``evolve.version_depth`` 0 / 1 / 2 in the logs."""


def ties_by_version(accuracy: torch.Tensor, depth: list[int], threshold: float = 0.5) -> dict[str, float]:
    """Which versions the batch's groups and its all-wrong groups are on: ``train/level/groups/{version}`` (share of
    the batch's groups) and ``train/level/all_wrong/{version}`` (share of the batch's groups that are all wrong *and*
    on that version, so the three sum to ``train/all_wrong_frac``). Over a run, sum(all_wrong) / sum(groups) of a
    version is how often its groups fail together. ``accuracy``: the rows' IoU, grouped contiguously per sample."""
    if not depth:
        return {}
    wrong = (torch.as_tensor(accuracy).detach().float().view(len(depth), -1).amax(1) < threshold).tolist()
    n = len(depth)
    out = {}
    for d, name in enumerate(VERSIONS):
        out[f"train/level/groups/{name}"] = sum(v == d for v in depth) / n
        out[f"train/level/all_wrong/{name}"] = sum(v == d and w for v, w in zip(depth, wrong)) / n
    return out


def level_stats(samples: list[Any]) -> dict[str, float]:
    """``train/level/{mean, max, sub_frac}`` over the batch's samples: the level each one's version carries and
    whether it is in its sub-problem version."""
    levels = [float((s.meta or {}).get("level", 0)) for s in samples]
    sub = [float(evolve.is_sub_problem(s.meta or {}, s.query)) for s in samples]
    if not levels:
        return {}
    return {
        "train/level/mean": sum(levels) / len(levels),
        "train/level/max": max(levels),
        "train/level/sub_frac": sum(sub) / len(sub),
    }
