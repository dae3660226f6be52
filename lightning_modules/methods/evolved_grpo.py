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

**In-step evolution** (``method.init_args.reroll: evolve``; experiments/evolved_grpo_results.md, "In-step evolution"). The
strategy moves a sample at the epoch boundary, so the group that converged is trained as it is and the edited version
arrives an epoch later. With ``reroll: evolve`` the adversary also acts inside the step: a group whose outcome converged
(all G answers correct, or all wrong, at ``correct_iou``) is generated again, once, on the version `evolve.next_level`
gives (a harder one, or its sub-problem / easier version), edited from the original toy scene in the training process
(`evolve.evolve`: the same pure functions the data server runs for visual edits, so the labels are as exact); those G
rows replace the group's in the step (same batch size, one extra engine call). ``reroll: resample`` re-generates the
same version instead (the control: as much extra sampling, no edit). The strategy still moves the pool from the first
try (the step output's ``pool_accuracy``), so the pool follows what the sample's own version scored. Only toy scenes are edited
(a real image's edits need the data server's painter: its groups are left as they are). The method's settings
``sub_levels``, ``easier``, ``max_level``, ``modality`` name the version the strategy would move to: give them the
strategy's values.
"""

from __future__ import annotations

import dataclasses
import zlib
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from core import objective, rewards
from core.rollout import Rollout, concat_rollouts, take_rows
from datamodules import evolve
from lightning_modules.engines.base import RolloutRequest
from lightning_modules.methods.base import MethodHost, RewardContext, RewardTerm, Scores
from lightning_modules.methods.grpo import GRPO
from lightning_modules.methods.syn_grpo import SynGRPO
from lightning_modules.models import fsdp

REROLL_MODES = ("off", "evolve", "resample")


class ProcessReward:
    """EvolvedGRPO's part of a method, mixed in before a GRPO-family base: the process reward term, the level logs,
    the in-step evolution. Args (``--model.method.init_args``, beside its base's): ``process_weight`` (>= 0; weight of R_process in the total),
    ``step_iou`` (IoU a step's box needs to count as correct); ``reroll`` (``off``, ``evolve`` or ``resample``: the
    module docstring), ``correct_iou`` (IoU an answer needs to count as correct for it), and the version rule's
    ``sub_levels``, ``easier``, ``max_level``, ``modality``, ``seed`` (as the ``instruction_evolution`` strategy's)."""

    def __init__(
        self,
        process_weight: float = 0.5,
        step_iou: float = 0.5,
        reroll: str = "off",
        correct_iou: float = 0.5,
        sub_levels: int = 1,
        easier: str = evolve.ISOLATE_KIND,
        max_level: int = evolve.MAX_LEVEL,
        modality: str = "any",
        seed: int = 0,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if process_weight < 0:
            raise ValueError(f"--model.method.init_args.process_weight must be >= 0, got {process_weight}")
        if not 0.0 < step_iou <= 1.0:
            raise ValueError(f"--model.method.init_args.step_iou must be in (0, 1], got {step_iou}")
        if reroll not in REROLL_MODES:
            raise ValueError(f"--model.method.init_args.reroll must be one of {REROLL_MODES}, got {reroll!r}")
        if not 0.0 < correct_iou <= 1.0:
            raise ValueError(f"--model.method.init_args.correct_iou must be in (0, 1], got {correct_iou}")
        if modality not in ("text", "visual", "any"):
            raise ValueError(f"--model.method.init_args.modality must be 'text', 'visual' or 'any', got {modality!r}")
        self.process_weight, self.step_iou = process_weight, step_iou
        self.reroll, self.correct_iou, self.modality, self.seed = reroll, correct_iou, modality, seed
        # the version rule, checked as the strategy checks it (`evolve.LevelState`)
        self.rule = evolve.LevelState(max_level=max_level, sub_levels=sub_levels, easier=easier)

    # ------------------------------------------------------------------------------------------------ in-step evolution
    def rollout(self, module: MethodHost, batch) -> Rollout:
        ro = super().rollout(module, batch)
        if self.reroll == "off" or not len(batch):
            return ro
        if fsdp.needs_lockstep(module.policy):
            raise ValueError(
                "--model.method.init_args.reroll re-generates the groups that converged, a number that differs between "
                "ranks, and a policy sharded with FSDP must generate in lockstep: set reroll: off, or train with DDP"
            )
        G = ro.group_size
        first = first_try_accuracy(batch, ro)
        swap: dict[int, Any] = {}
        for b, s in enumerate(batch):
            acc = first[b * G : (b + 1) * G]
            if any(a is None for a in acc):  # not a REC sample with a box
                continue
            correct = [a >= self.correct_iou for a in acc]
            if any(correct) and not all(correct):  # mixed: GRPO learns from it as it is
                continue
            new = s if self.reroll == "resample" else self.next_version(s, correct, int(module.global_step))
            if new is not None:
                swap[b] = new
        info = {"first_accuracy": [float(a) if a is not None else None for a in first], "rerolled": sorted(swap)}
        if not swap:
            ro.info.update(info)
            return ro
        chosen = sorted(swap)
        template = self.ctx.prompt_template
        requests = [
            RolloutRequest(self.prompt(module.processor, swap[b], template), swap[b].image, G, b) for b in chosen
        ]
        again = module.generate(padded(requests, reroll_requests(module, len(batch))))
        both = concat_rollouts([ro, again], module.processor.tokenizer.pad_token_id)
        n = len(batch) * G
        where = {b: n + j * G for j, b in enumerate(chosen)}
        order = [where.get(b, b * G) + k for b in range(len(batch)) for k in range(G)]
        out = take_rows(both, order, group_size=G)
        out.samples = [swap.get(b, s) for b, s in enumerate(batch)]
        out.info.update(info)
        return out

    def next_version(self, sample, correct: list[bool], step: int):
        """The sample at the version `evolve.next_level` moves it to from its own (the level its meta carries, the
        depth its question and edits show), edited from its original toy scene; None when it has no toy scene, stays
        where it is, or has no exact version there."""
        meta = sample.meta or {}
        orig = meta.get("original_meta") or meta
        if sample.task != "rec" or not orig.get("objects") or not orig.get("query"):
            return None
        here = evolve.Level(int(meta.get("level", 0) or 0), evolve.version_depth(meta, sample.query))
        there = evolve.next_level(here, correct, self.rule.max_level, self.rule.sub_levels)
        if there == here:
            return None
        rng = np.random.default_rng([self.seed, step, zlib.crc32(sample.sample_id.encode()), there.level, there.sub])
        record = {"meta": orig, "image": original_image(sample)}
        version = evolve.evolve(record, there, rng, modality=self.modality, easier=self.rule.easier)
        if version is None:
            return None
        new_meta = {
            **version.meta,
            "level": there.level,
            "original_meta": orig,
            "in_step": [here.level, here.sub, there.level, there.sub],
        }
        for key in ("original_image", "version"):
            if key in meta:
                new_meta[key] = meta[key]
        return dataclasses.replace(
            sample,
            image=version.image,
            query=version.query,
            boxes=[[float(v) for v in version.box]],
            meta=new_meta,
            image_path=sample.image_path if version.image is sample.image else None,  # None: drawn in the step
        )

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

    def step_outputs(self, batch, ro: Rollout, scores: Scores) -> dict[str, Any]:
        out = super().step_outputs(batch, ro, scores)
        if "first_accuracy" in ro.info:  # the pool's own versions' first try, which moves the pool (module docstring)
            out["pool_accuracy"] = [a if a is not None else 0.0 for a in ro.info["first_accuracy"]]
        return out

    def train_logs(self, scores: Scores, ro: Rollout) -> dict[str, float]:
        logs = super().train_logs(scores, ro)
        if "first_accuracy" in ro.info:
            logs.update(reroll_stats(ro.info, scores.parts["accuracy"], ro.group_size, self.correct_iou))
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


class EvolvedGRPO(ProcessReward, GRPO):
    """GRPO's accuracy and format rewards plus the prefix process reward (the module docstring)."""


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


def reroll_requests(module: MethodHost, batch_size: int) -> int:
    """How many requests the re-generation call makes at least: the batch's when the module's engine keeps a KV cache
    and a CUDA graph per row count (``RolloutEngine.fixed_rows``, on CUDA), so the call reuses the first call's (a GPU
    decodes B groups about as fast as a few, and the run keeps one engine instead of one per number of converged
    groups); else 0 (only the converged groups)."""
    fixed = getattr(module.rollout_engine, "fixed_rows", False)
    return batch_size if fixed and module.device.type == "cuda" else 0


def padded(requests: list[RolloutRequest], n: int) -> list[RolloutRequest]:
    """``requests`` followed by copies of the last one up to ``n`` requests (group ids -1: rows to drop); as they are
    when there are already ``n`` or more."""
    extra = [dataclasses.replace(requests[-1], group_id=-1) for _ in range(n - len(requests))]
    return list(requests) + extra


def first_try_accuracy(batch, ro: Rollout) -> list[float | None]:
    """Per row, the IoU of its first box with its REC sample's box (original pixels); None for a row whose sample has
    no box (OVD, a no-target query)."""
    G = ro.group_size
    out: list[float | None] = [None] * len(ro.texts)
    rows = [i for i in range(len(ro.texts)) if batch[i // G].task == "rec" and batch[i // G].boxes]
    if rows:
        iou = rewards.rec_accuracy_reward(
            [ro.texts[i] for i in rows],
            [batch[i // G].boxes[0] for i in rows],
            input_wh=[ro.input_wh[i] for i in rows],
            orig_wh=[batch[i // G].size for i in rows],
        )
        for i, v in zip(rows, iou):
            out[i] = float(v)
    return out


def original_image(sample) -> Image.Image:
    """The image of a sample's original scene: its own when no visual edit made it (no ``original_meta``), else the
    pool's original file (``meta["original_image"]``), else the scene re-rendered (`evolve.render_meta` reproduces
    an unedited toy scene bit for bit)."""
    meta = sample.meta or {}
    if "original_meta" not in meta:
        return sample.image
    path = meta.get("original_image")
    if path and Path(path).is_file():
        with Image.open(path) as im:
            return im.convert("RGB")
    return evolve.render_meta(meta["original_meta"])[0]


def reroll_stats(info: dict[str, Any], accuracy: torch.Tensor, group_size: int, threshold: float) -> dict[str, float]:
    """``train/level/reroll/*``: how the first try's groups converged (``first_all_wrong``, ``first_all_correct``:
    share of the batch's groups), the share re-generated (``frac``), and of those, the share whose second try is mixed
    (``mixed``: a gradient where the first try had none). ``accuracy``: the trained rows' IoU."""
    first = [a if a is not None else float("nan") for a in info["first_accuracy"]]
    groups = torch.tensor(first, dtype=torch.float32).view(-1, group_size)
    valid = ~groups.isnan().any(1)
    right = (groups >= threshold) & valid[:, None]
    n = groups.shape[0]
    chosen = info["rerolled"]
    after = torch.as_tensor(accuracy).detach().float().view(n, group_size) >= threshold
    mixed = [bool(after[b].any() and not after[b].all()) for b in chosen]
    return {
        "train/level/reroll/first_all_wrong": float((valid & ~right.any(1)).float().mean()),
        "train/level/reroll/first_all_correct": float((valid & right.all(1)).float().mean()),
        "train/level/reroll/frac": len(chosen) / n,
        "train/level/reroll/mixed": sum(mixed) / len(chosen) if chosen else 0.0,
    }
