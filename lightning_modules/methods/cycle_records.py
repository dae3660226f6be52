"""CycleGRPO's prediction records: ``train.py predict``'s per-sample rows, greedily, as its evaluation scores them.

A study bootstraps over these rows (``callbacks.predictions``): the means of their scores over a set are the set's
``test`` metrics (``callbacks.predictions.summarize``). Clips and mask regions get records of their own
(`CycleRecords.clip_record`); image boxes take the module's REC records. Both add, for a sample with a target, the
cycle (``cycle``: the caption, the consistency of its grounding with the own region and with the best look-alike, and
whether that counts as ``located`` / ``confused``, as ``Locatability`` counts them).
"""

from __future__ import annotations

from core.regions import NO_TARGET
from core.regions.sample_scores import locate, pair_consistency, st_scores
from lightning_modules.methods.base import MethodHost
from lightning_modules.methods.cycle_eval import CycleEvaluation, greedy

__all__ = ["CycleRecords"]


class CycleRecords:
    """The prediction records of a CycleGRPO run, through the groundings and the cycle of ``evaluation``."""

    def __init__(self, evaluation: CycleEvaluation) -> None:
        self.evaluation = evaluation
        self.regions = evaluation.regions

    def predict(self, module: MethodHost, batch, template: str, max_new_tokens: int) -> list[dict]:
        """The records of a test batch, greedily under ``template`` (module docstring). Clips: per clip the
        grounding's ``completion``, its ``region`` and the ground truth's (serialized), ``scores`` (intervals:
        ``tiou``; anchors: ``when``, ``where``, ``st``; masks: ``iou``), ``rewards.accuracy`` = the space's
        consistency, ``no_target`` / ``rejected`` / ``answered``."""
        r, ev = self.regions, self.evaluation
        engine = module.rollout_engine.for_evaluation()
        sampling = greedy(max_new_tokens)
        if r.masks is not None:
            r.masks.place(module.device)
        if r.video or r.masks is not None:  # masks: the REC records read boxes
            texts, gts, preds = ev.ground_clips(module.policy, module.processor, engine, batch, template, sampling)
            rows = [self.clip_record(s, t, g, p) for s, t, g, p in zip(batch, texts, gts, preds)]
        else:
            rows = module.rec_predictions(batch)
        targets, owns, lookalikes = ev.cycle_targets(batch)
        caps, back = ev.cycle_texts(module.policy, module.processor, engine, sampling, targets, template)
        index = {id(s): i for i, s in enumerate(batch)}
        own, other = pair_consistency(r.space, owns, lookalikes, back)
        for s, cap, c_own, c_other in zip(targets, caps, own, other):
            located, confused = locate(c_own, c_other, 0.5)
            rows[index[id(s)]]["cycle"] = {
                "caption": cap,
                "own": c_own,
                "lookalike": c_other,
                "located": located,
                "confused": confused,
            }
        return rows

    def clip_record(self, sample, text: str, gt, pred) -> dict:
        """`predict`'s record of one clip's (or mask-region image's) grounding ``text``, its ground truth ``gt`` and
        answered region ``pred`` (its ``cycle`` added by `predict`)."""
        r = self.regions
        space = r.space
        norm = space.normalize(pred) if pred is not None else None
        if r.masks is not None:  # pixel masks, GRES's per-sample IoU (a no-target query: 1 for a rejection)
            scores = {"iou": space.consistency(gt, pred)}
            accuracy = scores["iou"]
        elif space.name == "interval":
            scores = {"tiou": r.space_for(sample).consistency(gt, pred)}
            accuracy = scores["tiou"]
        else:
            slot = 1.0 / sample.clip.fps
            scores = dict(zip(("when", "where", "st"), st_scores(gt, pred, tau=r.tau, slot=slot)))
            accuracy = scores["st"]
        return {
            "sample_id": sample.sample_id,
            "task": "video" if r.video else "rec",
            "space": space.name,
            "query": sample.query,
            "completion": text,  # masks: the completion's span is the region (a pixel mask has no short text)
            "region": None if pred is None or r.masks is not None else space.serialize(pred),
            "gt_region": None if r.masks is not None else space.serialize(gt),
            "no_target": gt is NO_TARGET,
            "rejected": norm is NO_TARGET,
            "answered": norm is not None and norm is not NO_TARGET,
            "format_ok": pred is not None,
            "scores": scores,
            "rewards": {"accuracy": float(accuracy), "format": float(pred is not None)},
            "cycle": None,
        }
