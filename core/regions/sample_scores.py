"""CycleGRPO's metric rules for one sample at a time: what `CycleGRPO.predict`'s records write per row, and what the
``torchmetrics`` classes of ``lightning_modules/evaluation/cycle_metrics.py`` sum over a set (the same rules, so a
record and a metric never disagree; docs/cycle_grpo.md, "Metrics").
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from core.regions.anchors import AnchorSpace
from core.regions.base import NO_TARGET, RegionSpace
from core.regions.boxes import box_iou
from core.regions.intervals import IntervalSpace

__all__ = ["locate", "pair_consistency", "st_scores"]


def _slots(anchors: Sequence[tuple[float, Any]], slot: float) -> list[tuple[float, float]]:
    return [(max(t - slot / 2, 0.0), t + slot / 2) for t, _ in anchors]  # a slot never starts before the clip


def pair_consistency(
    space: RegionSpace, owns: Sequence[Any], lookalikes: Sequence[Sequence[Any]], preds: Sequence[Any]
) -> tuple[list[float], list[float]]:
    """Per caption: the consistency of its grounding ``preds[i]`` with its own region, and the best with any of its
    look-alike regions (0 without any), as ``Locatability.update_regions`` scores them."""
    if not len(owns) == len(lookalikes) == len(preds):
        raise ValueError(
            f"one own region, one list of look-alikes and one prediction per caption, got {len(owns)}, "
            f"{len(lookalikes)}, {len(preds)}"
        )
    own = [space.consistency(o, p) for o, p in zip(owns, preds)]
    other = [max((space.consistency(d, p) for d in ds), default=0.0) for ds, p in zip(lookalikes, preds)]
    return own, other


def locate(own_iou: float, distractor_iou: float, threshold: float = 0.5) -> tuple[bool, bool]:
    """``(located, confused)`` of one caption, as ``Locatability.update`` counts it (a nan / -inf distractor: none)."""
    other = 0.0 if math.isnan(distractor_iou) or distractor_iou == -math.inf else distractor_iou
    return own_iou >= threshold and own_iou > other, other >= threshold and other >= own_iou


def st_scores(gt: Any, pred: Any, tau: float = 3.0, slot: float = 0.5) -> tuple[float, float, float]:
    """``(when, where, st)`` of one anchor answer (``SpatioTemporalMetrics``' per-sample scores): the merged frame
    slots' tIoU, the mean IoU with the predicted box nearest in time (0 beyond ``tau``), Eq. 15."""
    space = AnchorSpace(tau=tau)
    if pred is None:
        return 0.0, 0.0, 0.0
    gt, pred = space.normalize(gt), space.normalize(pred)
    if gt is NO_TARGET or pred is NO_TARGET:
        v = 1.0 if gt is pred else 0.0
        return v, v, v
    when = IntervalSpace().consistency(_slots(gt, slot), _slots(pred, slot))
    where = 0.0
    for t, box in gt:
        dt, nearest = min((abs(t - tp), bp) for tp, bp in pred)
        where += box_iou(box, nearest) if dt <= space.tau else 0.0
    return when, where / len(gt), space.consistency(gt, pred)
