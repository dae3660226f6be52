"""Metrics of CycleGRPO's two directions, as ``torchmetrics.Metric`` classes (docs/cycle_grpo.md, "Metrics").

- ``RegionGroundingMetrics``: GRES's gIoU (mean per-sample IoU), cIoU (cumulative intersection / cumulative union)
  and N-acc (no-target accuracy), for any region space of ``core.regions``;
- ``TemporalGroundingMetrics``: mean tIoU and R1@{0.3, 0.5, 0.7} (Charades-STA's protocol, one prediction each);
- ``SpatioTemporalMetrics``: V-STaR-like *when* and *where* scores and the Eq. 15 consistency of anchor answers;
- ``Locatability``: how often a caption grounds back to its own region rather than to a look-alike (the toy
  analogue of DOVE's "does the caption single out its occurrence").

As in ``evaluation/metrics.py``: every state is a sum (float64 sums, int64 counts, ``dist_reduce_fx="sum"``),
so ``compute()`` after any split of the data over ``update()`` calls or ranks equals the one-shot value; a ratio with
nothing counted is ``nan``, not 0; results are float32 tensors. Unreadable predictions (None) are wrong answers:
IoU 0, and for a no-target sample not a rejection. The per-sample rules that records share with these classes
(``st_scores``, ``pair_consistency``, ``locate``) are ``core/regions/sample_scores.py``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric

from core.regions import NO_TARGET, AnchorSpace, IntervalSpace, RegionSpace, region_space
from core.regions.sample_scores import pair_consistency, st_scores

__all__ = [
    "Locatability",
    "RegionGroundingMetrics",
    "SpatioTemporalMetrics",
    "TemporalGroundingMetrics",
]


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    if den.item() == 0:
        return torch.tensor(float("nan"))
    return (num.double() / den.double()).float()


def _as_list(values: Tensor | Sequence[float]) -> list[float]:
    if isinstance(values, Tensor):
        return [float(v) for v in values.detach().reshape(-1).tolist()]
    return [float(v) for v in values]


def _check_lengths(gts: Sequence[Any], preds: Sequence[Any]) -> None:
    if len(gts) != len(preds):
        raise ValueError(f"update() needs one prediction per ground truth, got {len(preds)} for {len(gts)}")


class RegionGroundingMetrics(Metric):
    """gIoU, cIoU and N-acc of grounding answers in one region space (GRES's protocol).

    Per sample: ``IoU = space.consistency(gt, pred)``, so a correct rejection of a no-target sample scores 1 and a
    false alarm or a miss 0; ``(I, U) = space.overlap(gt, pred)``, so a false alarm adds the predicted region to the
    cumulative union and a miss the ground truth. ``giou = mean IoU``; ``ciou = sum I / sum U`` (over all samples, as
    GRES; nan when no sample has a region); ``n_acc`` = rejected no-target samples / no-target samples; ``t_acc`` =
    target samples answered with a region (not rejected, not unreadable) / target samples.

    ``update(gts, preds)`` takes regions as the space's ``parse`` returns them (``NO_TARGET`` and None allowed).
    """

    full_state_update = False

    def __init__(self, space: RegionSpace | str = "box", **kwargs: Any):
        super().__init__(**kwargs)
        self.space = region_space(space) if isinstance(space, str) else space
        for name in ("iou_sum", "inter_sum", "union_sum"):
            self.add_state(name, torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        for name in ("n", "nt_total", "nt_correct", "t_total", "t_answered"):
            self.add_state(name, torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, gts: Sequence[Any], preds: Sequence[Any]) -> None:
        _check_lengths(gts, preds)
        for gt, pred in zip(gts, preds):
            gt = self.space.normalize(gt)
            inter, union = self.space.overlap(gt, pred)
            self.iou_sum += self.space.consistency(gt, pred)
            self.inter_sum += inter
            self.union_sum += union
            self.n += 1
            if gt is NO_TARGET:
                self.nt_total += 1
                self.nt_correct += int(pred is NO_TARGET)
            else:
                self.t_total += 1
                self.t_answered += int(pred is not None and self.space.normalize(pred) is not NO_TARGET)

    def compute(self) -> dict[str, Tensor]:
        return {
            "giou": _ratio(self.iou_sum, self.n),
            "ciou": _ratio(self.inter_sum, self.union_sum),
            "n_acc": _ratio(self.nt_correct, self.nt_total),
            "t_acc": _ratio(self.t_answered, self.t_total),
        }


class TemporalGroundingMetrics(Metric):
    """Mean tIoU (``"tiou"``, a.k.a. mIoU) and ``"r1@{m}"`` = fraction of samples with tIoU >= m, for each threshold.

    ``update(tiou)`` takes per-sample tIoU values (``IntervalSpace.consistency``); ``update_regions(gts, preds,
    space)`` computes them.
    """

    full_state_update = False

    def __init__(self, thresholds: Sequence[float] = (0.3, 0.5, 0.7), **kwargs: Any):
        super().__init__(**kwargs)
        if not thresholds or not all(0.0 < t <= 1.0 for t in thresholds):
            raise ValueError(f"R1 thresholds must lie in (0, 1], got {tuple(thresholds)}")
        self.thresholds = tuple(float(t) for t in thresholds)
        self.add_state("tiou_sum", torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("n", torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")
        self.add_state("hits", torch.zeros(len(self.thresholds), dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, tiou: Tensor | Sequence[float]) -> None:
        values = _as_list(tiou)
        if any(not 0.0 <= v <= 1.0 for v in values):
            raise ValueError(f"tIoU values must lie in [0, 1], got {values}")
        t = torch.tensor(values, dtype=torch.float64, device=self.device)  # the states' device (NCCL syncs CUDA)
        self.tiou_sum += t.sum()
        self.n += t.numel()
        thresholds = torch.tensor(self.thresholds, dtype=torch.float64, device=self.device)
        self.hits += (t[None, :] >= thresholds[:, None]).sum(dim=1)

    def update_regions(self, gts: Sequence[Any], preds: Sequence[Any], space: IntervalSpace | None = None) -> None:
        _check_lengths(gts, preds)
        space = space or IntervalSpace()
        self.update([space.consistency(g, p) for g, p in zip(gts, preds)])

    def compute(self) -> dict[str, Tensor]:
        out = {"tiou": _ratio(self.tiou_sum, self.n)}
        for t, hits in zip(self.thresholds, self.hits):
            out[f"r1@{t:g}"] = _ratio(hits, self.n)
        return out


class SpatioTemporalMetrics(Metric):
    """When / where scores of (timestamp, box) answers, and their Eq. 15 consistency (``"st"``), per-sample means.

    - ``when``: each anchor stands for the frame slot ``[t - slot / 2, t + slot / 2]`` (``slot`` = the frame period,
      0.5 s at 2 fps); ``when`` is the tIoU of the two merged slot sets, i.e. did the answer name the right frames;
    - ``where``: for each ground-truth anchor, the IoU of its box with the box of the predicted anchor nearest in time
      (0 when none is within ``tau``), averaged over the ground truth's anchors: are the boxes right where the times
      roughly are (V-STaR scores boxes on the annotated frames; an anchor answer has its own times, so we pair by time);
    - ``st``: ``AnchorSpace(tau).consistency`` (Eq. 15), which needs both at once.

    No-target samples score 1 on all three when rejected and 0 otherwise; unreadable answers score 0.
    """

    full_state_update = False

    def __init__(self, tau: float = 3.0, slot: float = 0.5, **kwargs: Any):
        super().__init__(**kwargs)
        if not slot > 0:
            raise ValueError(
                f"SpatioTemporalMetrics(slot=...) is a frame period in seconds and must be > 0, got {slot}"
            )
        self.space, self.slot = AnchorSpace(tau=tau), float(slot)
        for name in ("when_sum", "where_sum", "st_sum"):
            self.add_state(name, torch.tensor(0.0, dtype=torch.float64), dist_reduce_fx="sum")
        self.add_state("n", torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def scores(self, gt: Any, pred: Any) -> tuple[float, float, float]:
        """``(when, where, st)`` of one sample (`st_scores`)."""
        return st_scores(gt, pred, self.space.tau, self.slot)

    def update(self, gts: Sequence[Any], preds: Sequence[Any]) -> None:
        _check_lengths(gts, preds)
        for gt, pred in zip(gts, preds):
            when, where, st = self.scores(gt, pred)
            self.when_sum += when
            self.where_sum += where
            self.st_sum += st
            self.n += 1

    def compute(self) -> dict[str, Tensor]:
        return {k: _ratio(getattr(self, f"{k}_sum"), self.n) for k in ("when", "where", "st")}


class Locatability(Metric):
    """Cycle locatability of captions: ground each caption back, then per caption compare the IoU with its own region
    and the best IoU with any distractor region (the look-alikes of the scene or clip).

    - ``locatability``: fraction with ``own >= threshold`` and ``own > max distractor`` (it found its own region);
    - ``confusion``: fraction with ``max distractor >= threshold`` and ``max distractor >= own`` (it found a
      look-alike instead: the caption described the kind, not the instance).

    The rest (neither) are captions that ground nowhere useful. Use ``-inf``, ``nan`` or 0 for "no distractor".
    """

    full_state_update = False

    def __init__(self, threshold: float = 0.5, **kwargs: Any):
        super().__init__(**kwargs)
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"Locatability(threshold=...) must lie in (0, 1], got {threshold}")
        self.threshold = float(threshold)
        for name in ("located", "confused", "n"):
            self.add_state(name, torch.tensor(0, dtype=torch.int64), dist_reduce_fx="sum")

    def update(self, own_iou: Tensor | Sequence[float], distractor_iou: Tensor | Sequence[float]) -> None:
        own = torch.tensor(_as_list(own_iou), dtype=torch.float64, device=self.device)
        other = torch.tensor(_as_list(distractor_iou), dtype=torch.float64, device=self.device)
        other = torch.nan_to_num(other, nan=0.0, neginf=0.0)
        if own.shape != other.shape:
            raise ValueError(f"one distractor IoU per caption: got {other.numel()} for {own.numel()} captions")
        self.located += ((own >= self.threshold) & (own > other)).sum()
        self.confused += ((other >= self.threshold) & (other >= own)).sum()
        self.n += own.numel()

    def update_regions(
        self, space: RegionSpace, owns: Sequence[Any], lookalikes: Sequence[Sequence[Any]], preds: Sequence[Any]
    ) -> None:
        """Per caption: its own region, the look-alike regions (the actor's other moves in the toy video world, the
        objects sharing the target's attributes in a scene) and the region its grounding answered; IoU =
        ``space.consistency``."""
        self.update(*pair_consistency(space, owns, lookalikes, preds))

    def compute(self) -> dict[str, Tensor]:
        return {"locatability": _ratio(self.located, self.n), "confusion": _ratio(self.confused, self.n)}
