"""Tests for lightning_modules/evaluation/metrics.py and core/metric_maths.py: hand-worked values, mAP against
pycocotools, and a 2-rank gloo sync."""

from __future__ import annotations

import contextlib
import io
import math
import os
import socket
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch

from core.metric_maths import greedy_match, group_diversity, safe_box_iou
from lightning_modules.evaluation.metrics import (
    DetectionMetrics,
    FormatRate,
    GroundingAccuracy,
    MeanIoU,
    ResponseEntropy,
    RewardDiversity,
)

SQUARE = [0.0, 0.0, 10.0, 10.0]  # area 100


# ----------------------------------------------------------------------------------------------------------------------
# IoU helpers
# ----------------------------------------------------------------------------------------------------------------------


def test_safe_box_iou_degenerate_and_invalid_boxes_are_zero_not_nan():
    boxes = torch.tensor(
        [
            [3.0, 3.0, 3.0, 3.0],  # zero area: torchvision alone gives 0/0 = NaN against itself
            [10.0, 10.0, 0.0, 0.0],  # inverted: negative "area"
            [0.0, 0.0, float("inf"), 10.0],  # non-finite
            [0.0, 0.0, float("nan"), 10.0],
            SQUARE,
        ]
    )
    iou = safe_box_iou(boxes, boxes)
    assert not torch.isnan(iou).any()
    expected = torch.zeros(5, 5)
    expected[4, 4] = 1.0  # only the valid square overlaps anything (itself)
    torch.testing.assert_close(iou, expected)


def test_safe_box_iou_matches_hand_values():
    # [0,0,10,5] inside the square: inter 50, union 100 -> 0.5; [5,5,15,15]: inter 25, union 175 -> 1/7
    iou = safe_box_iou(torch.tensor([SQUARE]), torch.tensor([[0.0, 0.0, 10.0, 5.0], [5.0, 5.0, 15.0, 15.0]]))
    torch.testing.assert_close(iou, torch.tensor([[0.5, 1.0 / 7.0]]))


# ----------------------------------------------------------------------------------------------------------------------
# REC: Acc@0.5 and mIoU
# ----------------------------------------------------------------------------------------------------------------------

# GT is the square for all four queries. IoUs: exact box 1; top half 0.5; shifted box 1/7; unparseable answer 0.
REC_PREDS = [SQUARE, [0.0, 0.0, 10.0, 5.0], torch.tensor([5.0, 5.0, 15.0, 15.0]), None]
REC_TARGET = torch.tensor([SQUARE] * 4)


def test_grounding_accuracy_hand_example():
    acc = GroundingAccuracy(threshold=0.5)
    acc.update(REC_PREDS, REC_TARGET)
    # IoU 1 and IoU 0.5 pass (>= tau); 1/7 and the None miss -> 2 / 4
    assert acc.compute().item() == pytest.approx(0.5)
    assert (acc.correct.item(), acc.total.item()) == (2, 4)

    strict = GroundingAccuracy(threshold=0.5, strict=True)  # VLM-R1's "> 0.5": the exact-0.5 pair now misses
    strict.update(REC_PREDS, REC_TARGET)
    assert strict.compute().item() == pytest.approx(0.25)


def test_grounding_accuracy_tensor_input_nan_row_is_a_miss_and_batches_accumulate():
    acc = GroundingAccuracy()
    acc.update(torch.tensor([SQUARE, [float("nan")] * 4]), REC_TARGET[:2])  # hit, unparseable
    acc.update(torch.tensor([[0.0, 0.0, 10.0, 4.0]]), REC_TARGET[:1])  # IoU 0.4: miss
    assert acc.compute().item() == pytest.approx(1 / 3)


def test_mean_iou_hand_example():
    miou = MeanIoU()
    miou.update(REC_PREDS, REC_TARGET)
    assert miou.compute().item() == pytest.approx((1.0 + 0.5 + 1.0 / 7.0 + 0.0) / 4)  # = 0.4107


def test_empty_metrics_are_nan_not_zero():
    assert math.isnan(GroundingAccuracy().compute().item())
    assert math.isnan(ResponseEntropy().compute().item())


def test_rec_rejects_length_mismatch_and_bad_boxes():
    with pytest.raises(ValueError, match="predictions for"):
        GroundingAccuracy().update([SQUARE], REC_TARGET[:2])
    with pytest.raises(ValueError, match="4 coordinates"):
        MeanIoU().update([[1.0, 2.0, 3.0]], REC_TARGET[:1])


# ----------------------------------------------------------------------------------------------------------------------
# Rollout health
# ----------------------------------------------------------------------------------------------------------------------


def test_response_entropy_is_token_weighted_and_ignores_masked_nan():
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, float("nan"), float("inf")]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]])
    metric = ResponseEntropy()
    metric.update(entropy, mask)
    # (1 + 2 + 3 + 4) / 4 tokens = 2.5; a sequence mean would give (2 + 4) / 2 = 3
    assert metric.compute().item() == pytest.approx(2.5)


def test_reward_diversity_hand_example():
    rewards = torch.tensor(
        [
            1.0, 1.0, 0.0, 0.0,  # mean 0.5, population var 0.25 -> V = 1
            0.5, 0.5, 0.5, 0.5,  # var 0 -> V = 0, a zero-variance group
            1.0, 0.0, 0.0, 0.0,  # mean 0.25, var (0.75^2 + 3 * 0.25^2) / 4 = 0.1875 -> V = 0.75
        ]
    )  # fmt: skip
    torch.testing.assert_close(group_diversity(rewards, 4), torch.tensor([1.0, 0.0, 0.75], dtype=torch.float64))
    metric = RewardDiversity(group_size=4)
    metric.update(rewards)
    out = metric.compute()
    assert out["diversity"].item() == pytest.approx((1.0 + 0.0 + 0.75) / 3)
    assert out["zero_variance_frac"].item() == pytest.approx(1 / 3)
    metric.update(torch.full((1, 4), 0.1))  # [B, G] input; identical floats: zero variance despite rounding
    assert metric.compute()["zero_variance_frac"].item() == pytest.approx(2 / 4)


def test_reward_diversity_rejects_ragged_groups():
    with pytest.raises(ValueError, match="group_size"):
        RewardDiversity(group_size=4).update(torch.zeros(6))
    with pytest.raises(ValueError, match=">= 2"):
        RewardDiversity(group_size=1)


def test_format_rate():
    metric = FormatRate()
    metric.update([True, False, True])
    metric.update(torch.tensor([True]))
    assert metric.compute().item() == pytest.approx(3 / 4)


# ----------------------------------------------------------------------------------------------------------------------
# OVD: greedy precision / recall and mAP
# ----------------------------------------------------------------------------------------------------------------------


def _box(x1: float, x2: float) -> list[float]:
    """A box spanning [x1, x2] horizontally and [0, 10] vertically: its IoU with another such box is the 1-D IoU."""
    return [x1, 0.0, x2, 10.0]


# Image 1: GT A = [5, 15], B = [8, 18]; p1 = [6, 16], p2 = [2, 13].
# IoU(p1, A) = 9/11 = .818, IoU(p1, B) = 8/12 = .667, IoU(p2, A) = 8/13 = .615, IoU(p2, B) = 5/16 = .3125.
# Greedy takes p1-A first (highest IoU); p2 is left with B at .3125 < .5 -> 1 match (an optimal assignment would
# find 2: p1-B, p2-A).
GREEDY_PREDS = torch.tensor([_box(6, 16), _box(2, 13)])
GREEDY_GT = torch.tensor([_box(5, 15), _box(8, 18)])


def test_greedy_match_takes_highest_iou_first():
    assert greedy_match(safe_box_iou(GREEDY_PREDS, GREEDY_GT), 0.5) == [(0, 0)]
    assert greedy_match(torch.zeros(0, 3)) == []


def _gp_gr_images() -> tuple[list[dict], list[dict]]:
    preds = [
        {"boxes": GREEDY_PREDS, "scores": torch.tensor([0.9, 0.8]), "labels": torch.tensor([0, 0])},  # 1 match
        # same box twice, wrong label then right label: only the label-1 prediction matches
        {"boxes": torch.tensor([SQUARE, SQUARE]), "scores": torch.tensor([0.7, 0.6]), "labels": torch.tensor([0, 1])},
        {"boxes": None},  # unparseable answer: no predictions
        {"boxes": torch.tensor([SQUARE])},  # prediction on an image without GT (labels / scores default)
    ]
    target = [
        {"boxes": GREEDY_GT, "labels": torch.tensor([0, 0])},
        {"boxes": torch.tensor([SQUARE]), "labels": torch.tensor([1])},
        {"boxes": torch.tensor([[20.0, 20.0, 30.0, 30.0]]), "labels": torch.tensor([0])},
        {"boxes": torch.zeros(0, 4), "labels": torch.zeros(0, dtype=torch.long)},
    ]
    return preds, target


def test_detection_gp_gr_hand_example():
    metric = DetectionMetrics()
    metric.update(*_gp_gr_images())
    out = metric.compute()
    # matched 1 + 1 + 0 + 0 = 2; predictions 2 + 2 + 0 + 1 = 5; GT 2 + 1 + 1 + 0 = 4
    assert (metric.matched.item(), metric.num_pred.item(), metric.num_gt.item()) == (2, 5, 4)
    assert out["gp"].item() == pytest.approx(2 / 5)
    assert out["gr"].item() == pytest.approx(2 / 4)
    assert set(out) == {"map", "map_50", "gp", "gr"}


def test_detection_single_image_shorthand_matches_dict_form():
    far = [50.0, 50.0, 60.0, 60.0]
    short = DetectionMetrics()
    short.update([SQUARE, far], [SQUARE])  # one image: bare box lists, class-agnostic, scores 1
    short.update(None, torch.tensor([SQUARE]))  # an unparseable answer on a second image
    full = DetectionMetrics()
    full.update(
        [{"boxes": torch.tensor([SQUARE, far]), "scores": torch.ones(2), "labels": torch.zeros(2)}, {"boxes": None}],
        [{"boxes": torch.tensor([SQUARE]), "labels": torch.zeros(1)}, {"boxes": torch.tensor([SQUARE])}],
    )
    out_short, out_full = short.compute(), full.compute()
    # GP: 1 match / 2 predictions; GR: 1 match / 2 GT boxes
    assert out_short["gp"].item() == pytest.approx(0.5) and out_short["gr"].item() == pytest.approx(0.5)
    for key in out_full:
        assert out_short[key].item() == pytest.approx(out_full[key].item())


def _random_detection_data(seed: int, num_images: int) -> tuple[list[dict], list[dict]]:
    """Images with 1-4 GT boxes of 2 classes; predictions are jittered GT (some missed, some mislabelled) plus false
    positives. Scores are distinct across the whole set so mAP does not depend on how ties are ordered."""
    g = torch.Generator().manual_seed(seed)
    preds, target = [], []
    score_pool = torch.randperm(1000, generator=g).float() / 1000.0
    k = 0
    for _ in range(num_images):
        m = int(torch.randint(1, 5, (1,), generator=g))
        xy = torch.rand(m, 2, generator=g) * 80
        wh = torch.rand(m, 2, generator=g) * 40 + 10
        gt_boxes = torch.cat([xy, xy + wh], dim=1)
        gt_labels = torch.randint(0, 2, (m,), generator=g)
        keep = torch.rand(m, generator=g) > 0.2
        jitter = (torch.rand(m, 4, generator=g) - 0.5) * 6
        det = (gt_boxes + jitter)[keep]
        det_labels = gt_labels[keep].clone()
        flip = torch.rand(det_labels.shape[0], generator=g) < 0.15
        det_labels[flip] = 1 - det_labels[flip]
        n_fp = int(torch.randint(0, 3, (1,), generator=g))
        fp_xy = torch.rand(n_fp, 2, generator=g) * 80
        fp = torch.cat([fp_xy, fp_xy + torch.rand(n_fp, 2, generator=g) * 30 + 5], dim=1)
        det = torch.cat([det, fp])
        det_labels = torch.cat([det_labels, torch.randint(0, 2, (n_fp,), generator=g)])
        scores = score_pool[k : k + det.shape[0]]
        k += det.shape[0]
        preds.append({"boxes": det, "scores": scores, "labels": det_labels})
        target.append({"boxes": gt_boxes, "labels": gt_labels})
    return preds, target


def _pycocotools_map(preds: list[dict], target: list[dict]) -> tuple[float, float]:
    from pycocotools.coco import COCO
    from pycocotools.cocoeval import COCOeval

    def xywh(b: torch.Tensor) -> list[float]:
        x1, y1, x2, y2 = b.tolist()
        return [x1, y1, x2 - x1, y2 - y1]

    images, annotations, detections = [], [], []
    for image_id, (p, t) in enumerate(zip(preds, target)):
        images.append({"id": image_id, "width": 200, "height": 200})
        for b, label in zip(t["boxes"], t["labels"].tolist()):
            box = xywh(b)
            annotations.append(
                {"id": len(annotations) + 1, "image_id": image_id, "category_id": label, "bbox": box,
                 "area": box[2] * box[3], "iscrowd": 0}
            )  # fmt: skip
        for b, s, label in zip(p["boxes"], p["scores"].tolist(), p["labels"].tolist()):
            detections.append({"image_id": image_id, "category_id": label, "bbox": xywh(b), "score": s})
    with contextlib.redirect_stdout(io.StringIO()):
        gt = COCO()
        gt.dataset = {"images": images, "annotations": annotations, "categories": [{"id": 0}, {"id": 1}]}
        gt.createIndex()
        evaluator = COCOeval(gt, gt.loadRes(detections), iouType="bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return float(evaluator.stats[0]), float(evaluator.stats[1])


def test_map_agrees_with_pycocotools():
    preds, target = _random_detection_data(seed=1, num_images=6)
    metric = DetectionMetrics()
    metric.update(preds[:4], target[:4])  # two batches, as in a validation loop
    metric.update(preds[4:], target[4:])
    out = metric.compute()
    ref_map, ref_map50 = _pycocotools_map(preds, target)
    assert 0.1 < ref_map < 0.95  # a non-trivial case: neither everything nor nothing matched
    assert out["map"].item() == pytest.approx(ref_map, abs=1e-6)
    assert out["map_50"].item() == pytest.approx(ref_map50, abs=1e-6)


def test_map_perfect_and_gp_gr_perfect():
    metric = DetectionMetrics()
    boxes = torch.tensor([SQUARE, [20.0, 20.0, 40.0, 50.0]])
    metric.update([{"boxes": boxes, "scores": torch.tensor([0.9, 0.8])}], [{"boxes": boxes}])
    out = metric.compute()
    assert [out[k].item() for k in ("map", "map_50", "gp", "gr")] == pytest.approx([1.0, 1.0, 1.0, 1.0])


# ----------------------------------------------------------------------------------------------------------------------
# Distributed sync: 2 CPU ranks over gloo, uneven shards
# ----------------------------------------------------------------------------------------------------------------------

# Rank 0 takes the first k items of each kind (groups: k prompts of G = 4 rewards), rank 1 the rest.
RANK_SPLIT = {"rec": 3, "det": 4, "groups": 2, "tokens": 1, "format": 2}


def _dataset() -> dict:
    """The union the ranks share out. Sizes differ from the split points so that the two shards are uneven."""
    g = torch.Generator().manual_seed(1)
    rec_target = torch.tensor([SQUARE] * 5)
    rec_preds = [SQUARE, None, [0.0, 0.0, 10.0, 5.0], [2.0, 2.0, 12.0, 12.0], [5.0, 5.0, 15.0, 15.0]]
    det_preds, det_target = _random_detection_data(seed=2, num_images=7)
    return {
        "rec": (rec_preds, rec_target),
        "det": (det_preds, det_target),
        "groups": torch.tensor([1, 1, 0, 0, 0.5, 0.5, 0.5, 0.5, 1, 0, 0, 0, 0.2, 0.9, 0.4, 0.4, 1, 1, 1, 1.0]),
        "tokens": (torch.rand(3, 5, generator=g) * 3, torch.rand(3, 5, generator=g) > 0.3),
        "format": [True, False, True, True, True],
    }


def _metrics() -> dict:
    return {
        "acc": GroundingAccuracy(),
        "miou": MeanIoU(),
        "entropy": ResponseEntropy(),
        "diversity": RewardDiversity(group_size=4),
        "format": FormatRate(),
        "det": DetectionMetrics(),
    }


def _update(metrics: dict, data: dict, rank: int | None = None) -> None:
    """Update every metric on the whole dataset (rank=None) or on one rank's shard (RANK_SPLIT)."""

    def take(name: str, seq, scale: int = 1):
        if rank is None:
            return seq
        k = RANK_SPLIT[name] * scale
        return seq[:k] if rank == 0 else seq[k:]

    rec_preds, rec_target = data["rec"]
    metrics["acc"].update(take("rec", rec_preds), take("rec", rec_target))
    metrics["miou"].update(take("rec", rec_preds), take("rec", rec_target))
    det_preds, det_target = data["det"]
    metrics["det"].update(take("det", det_preds), take("det", det_target))
    metrics["diversity"].update(take("groups", data["groups"], scale=4))
    entropy, mask = data["tokens"]
    metrics["entropy"].update(take("tokens", entropy), take("tokens", mask))
    metrics["format"].update(take("format", data["format"]))


def _results(metrics: dict) -> dict[str, float]:
    out = {}
    for name, metric in metrics.items():
        value = metric.compute()
        if isinstance(value, dict):
            out.update({f"{name}/{k}": float(v) for k, v in value.items()})
        else:
            out[name] = float(value)
    return out


def _ddp_worker(rank: int, world_size: int, port: int, out_dir: str) -> None:
    if sys.platform.startswith("linux"):
        os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size, timeout=timedelta(seconds=60)
    )
    try:
        metrics = _metrics()
        _update(metrics, _dataset(), rank)
        local_total = metrics["acc"].total.item()
        local_images = len(metrics["det"].groundtruth_box)
        results = _results(metrics)
        # compute() syncs into a temporary view: local states are restored afterwards, so a second compute is equal
        restored = metrics["acc"].total.item() == local_total and len(metrics["det"].groundtruth_box) == local_images
        again = _results(metrics)
        torch.save({"results": results, "again": again, "restored": restored}, Path(out_dir) / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_ddp_gloo_two_ranks_equal_single_process_on_union(tmp_path):
    import torch.multiprocessing as mp

    world_size, deadline = 2, time.monotonic() + 150
    context = mp.spawn(_ddp_worker, args=(world_size, _free_port(), str(tmp_path)), nprocs=world_size, join=False)
    try:
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                pytest.fail("DDP workers did not finish within 150 s (a hung collective?)")
    finally:
        for process in context.processes:  # only the two workers spawned above
            if process.is_alive():
                process.kill()

    single = _metrics()
    _update(single, _dataset())
    expected = _results(single)
    assert 0.0 < expected["det/map"] < 1.0 and 0.0 < expected["diversity/zero_variance_frac"] < 1.0
    for rank in range(world_size):
        saved = torch.load(tmp_path / f"rank{rank}.pt")
        assert saved["restored"], f"rank {rank}: compute() left synced states behind"
        for results in (saved["results"], saved["again"]):
            assert results.keys() == expected.keys()
            for key, value in expected.items():
                assert results[key] == pytest.approx(value, abs=1e-6), f"rank {rank}: {key}"
