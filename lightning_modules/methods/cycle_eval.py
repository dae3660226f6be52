"""CycleGRPO's evaluation: validation and test metrics of both directions, greedily (docs/cycle_grpo.md, "Metrics").

`CycleEvaluation` holds the metrics of every eval set (``<kind>/<set>``, created on the module's device: a multi-GPU
sync, NCCL, reduces CUDA states) and logs them at the epoch's end (`CycleEvaluation.eval_logs`):

- **clips and mask regions** (`evaluate_clips`): each query grounded (``RegionGroundingMetrics``: ``ciou``,
  ``n_acc``, ``t_acc``; intervals ``TemporalGroundingMetrics``: ``tiou``, ``r1@{0.3,0.5,0.7}``; anchors
  ``SpatioTemporalMetrics``: ``when``, ``where``, ``st``), then the cycle on each target: ``locatability`` /
  ``confusion`` against its look-alikes and ``cycle_acc50``;
- **image boxes** (`evaluate`): the cycle's ``locatability`` / ``confusion``, then the module's REC evaluator grounds
  the queries.

The cycle (`cycle_texts`): caption the target's region, ground the stripped caption back under the evaluation
template, and compare the answered region with the target's own and its look-alikes' (`cycle_targets`): a caption that
names the kind, not the instance, finds a look-alike. The prediction records (`methods/cycle_records.py`) run the same
groundings and cycle.
"""

from __future__ import annotations

from typing import Any

import torch

from lightning_modules.engines.base import RolloutRequest, Sampling
from lightning_modules.evaluation.cycle_metrics import (
    Locatability,
    RegionGroundingMetrics,
    SpatioTemporalMetrics,
    TemporalGroundingMetrics,
)
from lightning_modules.methods.base import MethodHost
from lightning_modules.methods.cycle_masks import lookalike_masks
from lightning_modules.methods.cycle_regions import CycleRegions
from lightning_modules.methods.cycle_rewards import caption_text, image_lookalikes

__all__ = ["CycleEvaluation", "greedy"]


def greedy(max_new_tokens: int) -> Sampling:
    """Greedy sampling of up to ``max_new_tokens``: how every evaluation of the method answers."""
    return Sampling(max_new_tokens=max_new_tokens, greedy=True)


class CycleEvaluation:
    """The metrics of every eval set of a CycleGRPO run in the space of ``regions`` (module docstring)."""

    def __init__(self, regions: CycleRegions) -> None:
        self.regions = regions
        self.metrics: dict[str, dict[str, Any]] = {}
        """``<kind>/<set>`` (``SFTModule``'s clips: ``<kind>/<set>/<space>``) -> metric name -> metric."""

    def evaluate(self, module: MethodHost, key: str, batch, template: str, max_new_tokens: int) -> bool:
        """Video samples and mask regions: `evaluate_clips` (masks: GRES's ``giou`` / ``ciou`` / ``n_acc`` /
        ``t_acc`` on the decoded masks, the box evaluator having nothing to read), True. Image boxes: the cycle's
        locatability of captions (``<key>/locatability``, ``.../confusion``), False: the module's REC evaluator
        grounds the queries."""
        r = self.regions
        engine = module.rollout_engine.for_evaluation()
        if r.video or r.masks is not None:
            if r.masks is not None:
                r.masks.place(module.device)
            self.evaluate_clips(
                module.policy, module.processor, engine, batch, key, template, max_new_tokens, module.device
            )
            return True
        if key not in self.metrics:  # on the module's device: a multi-GPU sync (NCCL) reduces CUDA states
            self.metrics[key] = {"locatability": Locatability(0.5).to(module.device)}
        targets, owns, lookalikes = self.cycle_targets(batch)
        back = self.cycle_texts(module.policy, module.processor, engine, greedy(max_new_tokens), targets, template)[1]
        self.metrics[key]["locatability"].update_regions(r.space, owns, lookalikes, back)
        return False

    def evaluate_clips(
        self, policy, processor, engine, batch, key: str, template: str, max_new_tokens: int, device
    ) -> None:
        """Clips (and mask-region images), greedily, into the metrics of eval set ``key`` (``<kind>/<set>``, created on
        ``device``): each query grounded under ``template``, then the cycle on each target moment: caption its region,
        ground the stripped caption back; ``locatability`` / ``confusion`` against the actor's other moves, and
        ``cycle_acc50`` (consistency with its own region >= 0.5, look-alikes aside). Also the video SFT stage's clip
        validation (``SFTModule``, under the key ``<kind>/<set>/<space>``), so the stage reports what the RL run on its
        checkpoint will."""
        r = self.regions
        sampling = greedy(max_new_tokens)
        _, gts, preds = self.ground_clips(policy, processor, engine, batch, template, sampling)
        if key not in self.metrics:
            mets = {"region": RegionGroundingMetrics(r.space), "locatability": Locatability(0.5)}
            mets["cycle"] = Locatability(0.5)
            if r.space.name == "interval":
                mets["temporal"] = TemporalGroundingMetrics((0.3, 0.5, 0.7))
            elif r.space.name == "anchor":
                mets["st"] = SpatioTemporalMetrics(tau=r.tau, slot=1.0 / batch[0].clip.fps)
            self.metrics[key] = {k: m.to(device) for k, m in mets.items()}  # NCCL reduces CUDA states
        mets = self.metrics[key]
        mets["region"].update(gts, preds)
        if "temporal" in mets:
            mets["temporal"].update([r.space_for(s).consistency(g, p) for s, g, p in zip(batch, gts, preds)])
        elif "st" in mets:
            mets["st"].update(gts, preds)
        targets, owns, lookalikes = self.cycle_targets(batch)
        back = self.cycle_texts(policy, processor, engine, sampling, targets, template)[1]
        mets["locatability"].update_regions(r.space, owns, lookalikes, back)
        mets["cycle"].update_regions(r.space, owns, [[] for _ in targets], back)

    def ground_clips(self, policy, processor, engine, batch, template: str, sampling) -> tuple[list[str], list, list]:
        """Each clip's query grounded under ``template``: (completions, ground-truth regions, predicted regions in
        the ground truth's frame, None when unreadable)."""
        r = self.regions
        r.check_samples(batch)
        requests = [RolloutRequest(r.prompt(processor, s.query, template), s.image, 1, i) for i, s in enumerate(batch)]
        ro = engine.generate(policy, processor, requests, sampling)
        if r.masks is not None:
            r.masks.prefetch(zip(batch, ro.texts))
        preds = [r.predicted_region(s, t, wh) for s, t, wh in zip(batch, ro.texts, ro.input_wh)]
        return list(ro.texts), [r.gt_region(s) for s in batch], preds

    def cycle_targets(self, batch) -> tuple[list, list, list]:
        """The samples the cycle runs on (a clip with a target moment; a scene with one referred box), their own
        regions and their look-alike regions (the actor's other moves; the objects sharing the target's shape or
        colour)."""
        r = self.regions
        if r.video:
            targets = [s for s in batch if s.intervals]
            return (
                targets,
                [s.region(r.space.name) for s in targets],
                [s.lookalike_regions(r.space.name) for s in targets],
            )
        targets = [s for s in batch if len(s.boxes) == 1]
        if r.masks is not None:  # pixel masks of each sample's image (the unbound space's IoU compares them)
            return targets, [r.masks.gt(s) for s in targets], [lookalike_masks(s) for s in targets]
        return targets, [tuple(s.boxes[0]) for s in targets], [image_lookalikes(s) for s in targets]

    def cycle_texts(self, policy, processor, engine, sampling, targets, template: str) -> tuple[list[str], list]:
        """The cycle on each target region, greedily (the toy analogue of DOVE): caption it, ground the stripped
        caption back under ``template``; the captions (the texts as written) and the regions their groundings answer
        (None when unreadable), to score against the targets' own regions and look-alikes (`cycle_targets`)."""
        if not targets:
            return [], []
        r = self.regions
        captions = engine.generate(
            policy,
            processor,
            [RolloutRequest(r.caption_prompt(processor, s), s.image, 1, i) for i, s in enumerate(targets)],
            sampling,
        )
        groundings = engine.generate(
            policy,
            processor,
            [
                RolloutRequest(r.grounding_prompt(processor, caption_text(t), template), s.image, 1, i)
                for i, (s, t) in enumerate(zip(targets, captions.texts))
            ],
            sampling,
        )
        preds = [r.predicted_region(s, t, wh) for s, t, wh in zip(targets, groundings.texts, groundings.input_wh)]
        return list(captions.texts), preds

    def eval_logs(self, kind: str) -> dict[str, float]:
        """The epoch's metrics of every eval set of ``kind`` (``{kind}/{set}/{metric}``; nan ones left out), then
        reset."""
        out = {}
        for key, mets in self.metrics.items():
            if not key.startswith(f"{kind}/"):
                continue
            for part, m in mets.items():
                for k, v in m.compute().items():
                    if part == "cycle":  # own region only: its locatability is the cycle's Acc@0.5
                        if k != "locatability":
                            continue
                        k = "cycle_acc50"
                    if (k != "giou" or not self.regions.video) and not torch.isnan(v):  # clips: giou repeats tiou / st
                        out[f"{key}/{k}"] = float(v)
                m.reset()
        return out
