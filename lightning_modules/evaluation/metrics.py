"""Evaluation and monitoring metrics for Syn-GRPO (REC grounding, OVD detection, rollout health).

Every class is a ``torchmetrics.Metric``: ``update()`` accumulates per-rank states, ``compute()`` first syncs them
across processes (torch.distributed, any backend) and then reduces. Scalar metrics keep *sum* states (numerator and
denominator, ``dist_reduce_fx="sum"``), so the synced value is exactly the single-process value on the union of the
ranks' data, whatever the number of samples each rank saw. ``DetectionMetrics`` keeps per-image lists for mAP and
packs them before gathering, so ranks may also hold different numbers of images (see ``DetectionMetrics._sync_dist``).

Conventions (see docs/metrics.md):
- Boxes are ``[x1, y1, x2, y2]`` in the same pixel frame for prediction and target (rescaling a Qwen2.5-VL answer from
  the resized input back to original pixels is the caller's job). Continuous coordinates, no ``+1`` pixel convention.
- A box that is degenerate (``x2 <= x1`` or ``y2 <= y1``) or has a non-finite coordinate has IoU 0 with everything.
- A ratio whose denominator is 0 (nothing was counted) is ``nan``, not 0: "no data" must not look like "collapsed".
- Results are float32 tensors; sums are accumulated in float64 and counts in int64.

The tensor maths they share (``safe_box_iou``, ``greedy_match``, ``group_diversity``, ...) is ``core/metric_maths.py``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor
from torchmetrics import Metric
from torchmetrics.detection import MeanAveragePrecision
from torchmetrics.utilities.distributed import gather_all_tensors

from core.metric_maths import (
    BoxLike,
    _as_float,
    as_box_tensor,
    greedy_match,
    group_diversity,
    paired_box_iou,
    safe_box_iou,
)

__all__ = [
    "DetectionMetrics",
    "FormatRate",
    "GroundingAccuracy",
    "MeanIoU",
    "ResponseEntropy",
    "RewardDiversity",
]


def _ratio(num: Tensor, den: Tensor) -> Tensor:
    """num / den as float32; nan when den == 0 (nothing was counted)."""
    num, den = num.to(torch.float64), den.to(torch.float64)
    return torch.where(den > 0, num / den.clamp(min=1), torch.full_like(num, float("nan"))).float()


# ----------------------------------------------------------------------------------------------------------------------
# REC: one predicted box per query
# ----------------------------------------------------------------------------------------------------------------------


def add_sum_states(metric: Metric, **dtypes: torch.dtype) -> None:
    """Scalar states of ``metric`` that start at 0 and are summed across processes (``dist_reduce_fx="sum"``)."""
    for name, dtype in dtypes.items():
        metric.add_state(name, default=torch.tensor(0, dtype=dtype), dist_reduce_fx="sum")


class _SumMetric(Metric):
    """A metric whose states are sums (see `add_sum_states`): not differentiable, no full-state update."""

    is_differentiable = False
    higher_is_better: bool | None = None
    full_state_update = False


class _PairedBoxMetric(_SumMetric):
    """Shared input handling for one-box-per-query metrics (REC)."""

    def _iou(self, preds: Tensor | Sequence[BoxLike], target: Tensor | Sequence[Sequence[float]]) -> Tensor:
        target = torch.as_tensor(target, device=self.device) if not isinstance(target, Tensor) else target
        target = _as_float(target).reshape(-1, 4)
        pred_boxes, parsed = as_box_tensor(preds, device=target.device)
        if pred_boxes.shape[0] != target.shape[0]:
            raise ValueError(f"got {pred_boxes.shape[0]} predictions for {target.shape[0]} targets")
        return paired_box_iou(pred_boxes, target) * parsed  # [N], unparseable answers score 0


class GroundingAccuracy(_PairedBoxMetric):
    """Acc@tau for REC: the fraction of queries whose predicted box has IoU >= tau with the GT box.

    ``update(preds, target)``: ``preds`` is a ``[N, 4]`` tensor or a list with ``None`` for unparseable answers (a
    miss), ``target`` is ``[N, 4]``. ``strict=True`` uses ``IoU > tau`` as VLM-R1's evaluation script does; the two
    only differ for a pair whose IoU is exactly tau.
    """

    higher_is_better = True
    correct: Tensor
    total: Tensor

    def __init__(self, threshold: float = 0.5, strict: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if not 0.0 <= threshold <= 1.0:
            raise ValueError(f"threshold must be in [0, 1], got {threshold}")
        self.threshold = threshold
        self.strict = strict
        add_sum_states(self, correct=torch.long, total=torch.long)

    def update(self, preds: Tensor | Sequence[BoxLike], target: Tensor | Sequence[Sequence[float]]) -> None:
        iou = self._iou(preds, target)
        hit = iou > self.threshold if self.strict else iou >= self.threshold
        self.correct += hit.sum().to(self.correct.device)
        self.total += iou.numel()

    def compute(self) -> Tensor:
        return _ratio(self.correct, self.total)


class MeanIoU(_PairedBoxMetric):
    """Mean IoU between predicted and GT boxes over queries; unparseable answers count as IoU 0."""

    higher_is_better = True
    iou_sum: Tensor
    total: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        add_sum_states(self, iou_sum=torch.float64, total=torch.long)

    def update(self, preds: Tensor | Sequence[BoxLike], target: Tensor | Sequence[Sequence[float]]) -> None:
        iou = self._iou(preds, target)
        self.iou_sum += iou.sum().to(self.iou_sum)
        self.total += iou.numel()

    def compute(self) -> Tensor:
        return _ratio(self.iou_sum, self.total)


# ----------------------------------------------------------------------------------------------------------------------
# Rollout health: entropy, ground-truth diversity, format rate
# ----------------------------------------------------------------------------------------------------------------------


class ResponseEntropy(_SumMetric):
    """Token-weighted mean entropy of sampled completions: sum(entropy * mask) / sum(mask) over all tokens seen.

    ``update(entropy [N, T], mask [N, T])``; the mask selects completion tokens (not prompt, not padding). Masked-out
    positions are ignored even if they hold NaN / inf. Long completions weigh more than short ones (token mean, not
    sequence mean), matching the token-mean loss aggregation.
    """

    entropy_sum: Tensor
    token_count: Tensor

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        add_sum_states(self, entropy_sum=torch.float64, token_count=torch.long)

    def update(self, entropy: Tensor, mask: Tensor) -> None:
        if entropy.shape != mask.shape:
            raise ValueError(
                f"entropy and mask must have the same shape, got {tuple(entropy.shape)} and {tuple(mask.shape)}"
            )
        keep = mask.bool()
        values = torch.where(keep, entropy.detach().to(torch.float64), 0.0)  # [N, T]; where, not *, so NaN pads vanish
        self.entropy_sum += values.sum().to(self.entropy_sum.device)
        self.token_count += keep.sum().to(self.token_count.device)

    def compute(self) -> Tensor:
        return _ratio(self.entropy_sum, self.token_count)


class RewardDiversity(_SumMetric):
    """Mean ground-truth diversity V(q) over prompts, and the fraction of zero-variance groups.

    ``update(acc_rewards)`` with ``acc_rewards`` ``[B * G]`` (prompt-major) or ``[B, G]``: the *accuracy* reward
    only (IoU for REC, s_ovd * mAP for OVD), not the summed reward. A group is zero-variance when its population
    variance is <= ``atol``: such a prompt gives every completion the same advantage (0) and no learning signal.
    ``compute()`` -> ``{"diversity": mean_q V(q), "zero_variance_frac": ...}``. This is the raw V(q); the smoothed
    V~(q) and global_avg belong to the objective.
    """

    diversity_sum: Tensor
    zero_variance: Tensor
    num_groups: Tensor

    def __init__(self, group_size: int, atol: float = 1e-12, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        if group_size < 2:
            raise ValueError(f"group_size must be >= 2 (a variance needs two completions per prompt), got {group_size}")
        self.group_size = group_size
        self.atol = atol
        add_sum_states(self, diversity_sum=torch.float64, zero_variance=torch.long, num_groups=torch.long)

    def update(self, acc_rewards: Tensor | Sequence[float]) -> None:
        rewards = acc_rewards if isinstance(acc_rewards, Tensor) else torch.as_tensor(acc_rewards, dtype=torch.float64)
        v = group_diversity(rewards, self.group_size)  # [B]
        self.diversity_sum += v.sum().to(self.diversity_sum.device)
        self.zero_variance += (v * 0.25 <= self.atol).sum().to(self.zero_variance.device)
        self.num_groups += v.numel()

    def compute(self) -> dict[str, Tensor]:
        return {
            "diversity": _ratio(self.diversity_sum, self.num_groups),
            "zero_variance_frac": _ratio(self.zero_variance, self.num_groups),
        }


class FormatRate(_SumMetric):
    """Fraction of completions whose four parts (think, diversity, description, answer) all parsed.

    ``update(parsed)`` with a bool tensor ``[N]`` or a list of bools (one per completion).
    """

    higher_is_better = True

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        add_sum_states(self, parsed=torch.long, total=torch.long)  # counts of well-formed and of all completions

    def update(self, parsed: Tensor | Sequence[bool]) -> None:
        ok = torch.as_tensor(parsed, device=self.device).reshape(-1).bool()
        self.parsed += ok.sum().to(self.parsed.device)
        self.total += ok.numel()

    def compute(self) -> Tensor:
        return _ratio(self.parsed, self.total)


# ----------------------------------------------------------------------------------------------------------------------
# OVD: COCO mAP + the paper's greedy precision / recall
# ----------------------------------------------------------------------------------------------------------------------

# Per-image list states of MeanAveragePrecision (bbox): trailing shape and dtype of one image's tensor. Fixed dtypes
# let a rank with no images send a correctly typed empty tensor during sync.
_LIST_STATE_LAYOUT: dict[str, tuple[tuple[int, ...], torch.dtype]] = {
    "detection_box": ((4,), torch.float32),
    "detection_scores": ((), torch.float32),
    "detection_labels": ((), torch.long),
    "groundtruth_box": ((4,), torch.float32),
    "groundtruth_labels": ((), torch.long),
    "groundtruth_crowds": ((), torch.long),
    "groundtruth_area": ((), torch.float32),
}
_MASK_STATES = ("detection_mask", "groundtruth_mask")  # always empty for iou_type="bbox"


ImageBoxes = Tensor | Sequence[Sequence[float]]


def _is_image_boxes(target: Any) -> bool:
    """True for one image's bare boxes ([m, 4] tensor or non-empty list of boxes), False for a list of dicts."""
    if target is None:
        return False
    return isinstance(target, Tensor) or (len(target) > 0 and not isinstance(target[0], dict))


def _boxes_or_empty(boxes: ImageBoxes | None) -> Tensor:
    if boxes is None or len(boxes) == 0:
        return torch.zeros(0, 4)
    return torch.as_tensor(boxes if isinstance(boxes, Tensor) else [list(map(float, b)) for b in boxes])


class DetectionMetrics(MeanAveragePrecision):
    """OVD metrics: COCO mAP (torchmetrics, faster_coco_eval backend) plus greedy precision / recall at IoU 0.5.

    ``update(preds, target)`` takes torchmetrics' detection format, one dict per image:
    ``preds[i] = {"boxes": [n, 4] xyxy, "scores": [n], "labels": [n]}``, ``target[i] = {"boxes": [m, 4], "labels":
    [m]}``. ``scores`` defaults to 1 (an MLLM answer has no confidences; mAP then ranks ties by input order) and
    ``labels`` to 0 (class-agnostic). An unparseable answer is an image with no predicted boxes (``boxes`` may be
    ``None`` or empty). Shorthand for one image without labels or scores: ``update(pred_boxes, gt_boxes)`` with
    ``[n, 4]`` tensors or lists of boxes. (Two empty lists read as zero images; as one empty image they would change
    nothing either.)

    GP / GR (the paper's Table 2): per image, predictions and GT boxes of the *same label* are matched one-to-one by
    ``greedy_match`` at IoU >= ``iou_threshold``; GP = sum(matched) / sum(N_pred) and GR = sum(matched) / sum(N_gt)
    over the dataset (micro-average; sum states). All predictions count for GP / GR, whereas mAP keeps the top
    ``max_detection_thresholds[-1]`` (100) by score per image.

    ``compute()`` -> ``{"map", "map_50", "gp", "gr"}`` (float32 scalars; mAP is -1 when there is no GT, COCO style).
    """

    matched: Tensor
    num_pred: Tensor
    num_gt: Tensor

    def __init__(self, iou_threshold: float = 0.5, backend: str = "faster_coco_eval", **kwargs: Any) -> None:
        if kwargs.pop("iou_type", "bbox") != "bbox":
            raise ValueError("DetectionMetrics only supports iou_type='bbox'")
        if kwargs.get("box_format", "xyxy") != "xyxy":
            raise ValueError("DetectionMetrics expects xyxy boxes (GP / GR matching assumes them)")
        super().__init__(iou_type="bbox", backend=backend, **kwargs)
        self.iou_threshold = iou_threshold
        add_sum_states(self, matched=torch.long, num_pred=torch.long, num_gt=torch.long)
        unknown = {
            name
            for name, default in self._defaults.items()
            if isinstance(default, list) and name not in _LIST_STATE_LAYOUT and name not in _MASK_STATES
        }
        if unknown:  # a torchmetrics upgrade added per-image states that _sync_dist would not gather
            raise RuntimeError(f"DetectionMetrics._sync_dist does not know the MeanAveragePrecision states {unknown}")

    def _normalise(self, item: dict[str, Any], is_pred: bool) -> dict[str, Tensor]:
        boxes = item.get("boxes")
        boxes = torch.zeros(0, 4) if boxes is None else torch.as_tensor(boxes)
        boxes = boxes.to(device=self.device, dtype=torch.float32).reshape(-1, 4)
        n = boxes.shape[0]
        labels = item.get("labels")
        labels = torch.zeros(n) if labels is None else torch.as_tensor(labels)
        out = {"boxes": boxes, "labels": labels.to(device=self.device, dtype=torch.long).reshape(-1)}
        if is_pred:
            scores = item.get("scores")
            scores = torch.ones(n) if scores is None else torch.as_tensor(scores)
            out["scores"] = scores.to(device=self.device, dtype=torch.float32).reshape(-1)
        else:
            crowds = item.get("iscrowd")
            crowds = torch.zeros(n) if crowds is None else torch.as_tensor(crowds)
            out["iscrowd"] = crowds.to(device=self.device, dtype=torch.long).reshape(-1)
            area = item.get("area")
            area = torch.zeros(n) if area is None else torch.as_tensor(area)  # 0 -> torchmetrics uses the box area
            out["area"] = area.to(device=self.device, dtype=torch.float32).reshape(-1)
        return out

    def update(self, preds: list[dict[str, Any]] | ImageBoxes, target: list[dict[str, Any]] | ImageBoxes) -> None:
        if _is_image_boxes(preds) or _is_image_boxes(target):  # one image given as bare boxes: class-agnostic, scores 1
            preds, target = [{"boxes": _boxes_or_empty(preds)}], [{"boxes": _boxes_or_empty(target)}]
        if len(preds) != len(target):
            raise ValueError(f"got {len(preds)} prediction dicts for {len(target)} target dicts (one per image each)")
        preds_n = [self._normalise(p, is_pred=True) for p in preds]
        target_n = [self._normalise(t, is_pred=False) for t in target]
        super().update(preds_n, target_n)
        for p, t in zip(preds_n, target_n):
            iou = safe_box_iou(p["boxes"], t["boxes"])  # [P, G]
            iou = torch.where(p["labels"][:, None] == t["labels"][None, :], iou, -1.0)  # never match across labels
            self.matched += len(greedy_match(iou, self.iou_threshold))
            self.num_pred += p["boxes"].shape[0]
            self.num_gt += t["boxes"].shape[0]

    def compute(self) -> dict[str, Tensor]:
        result = super().compute()
        return {
            "map": result["map"].float(),
            "map_50": result["map_50"].float(),
            "gp": _ratio(self.matched, self.num_pred),
            "gr": _ratio(self.matched, self.num_gt),
        }

    def _sync_dist(self, dist_sync_fn: Callable | None = None, process_group: Any | None = None) -> None:
        """Gather per-image lists as one flat tensor plus per-image lengths; sum the counters.

        torchmetrics' default gathers every list element with its own collective, which deadlocks (or mixes data)
        when ranks hold different numbers of images: the last validation batch, an uneven shard. Here every rank
        makes the same two collectives per state whatever its image count. Images end up rank-major (all of rank 0's,
        then rank 1's, ...), the order a single process would see for the concatenated shards.
        """
        gather = dist_sync_fn or gather_all_tensors
        group = process_group or self.process_group
        for name, (trailing, dtype) in _LIST_STATE_LAYOUT.items():
            items: list[Tensor] = getattr(self, name)
            lengths = torch.tensor([t.shape[0] for t in items], dtype=torch.long, device=self.device)  # [n_images]
            if items:
                flat = torch.cat([t.to(dtype).reshape(-1, *trailing) for t in items])
            else:
                flat = torch.zeros((0, *trailing), dtype=dtype, device=self.device)
            all_lengths, all_flat = gather(lengths, group=group), gather(flat, group=group)
            merged: list[Tensor] = []
            for rank_lengths, rank_flat in zip(all_lengths, all_flat):
                merged.extend(torch.split(rank_flat, rank_lengths.tolist()))
            setattr(self, name, merged)
        for name in ("matched", "num_pred", "num_gt"):
            setattr(self, name, torch.stack(gather(getattr(self, name), group=group)).sum(dim=0))
