"""Tests for lightning_modules/evaluation/cycle_metrics.py (and core/regions/sample_scores.py): hand-worked values and
chunked updates equal to one-shot ones."""

from __future__ import annotations

import math

import pytest
import torch

from core.regions import NO_TARGET, IntervalSpace, MaskSpace
from core.regions.sample_scores import locate
from lightning_modules.evaluation.cycle_metrics import (
    Locatability,
    RegionGroundingMetrics,
    SpatioTemporalMetrics,
    TemporalGroundingMetrics,
)

A = [0.0, 0.0, 10.0, 10.0]  # area 100
HALF = [5.0, 0.0, 15.0, 10.0]  # IoU with A: 50 / 150 = 1/3

# (gt, pred) with per-sample IoU, intersection, union worked by hand:
GROUNDING = [
    (A, HALF),  # IoU 1/3, I 50, U 150
    (A, A),  # IoU 1, I 100, U 100
    (NO_TARGET, NO_TARGET),  # correct rejection: IoU 1, I 0, U 0
    (NO_TARGET, [0, 0, 5, 10]),  # false alarm: IoU 0, I 0, U 50 (the predicted box)
    (A, None),  # unreadable: IoU 0, I 0, U 100 (the missed ground truth)
]


def _values(out: dict) -> dict:
    return {k: float(v) for k, v in out.items()}


def _check_chunked(make, args_list, chunks):
    """compute() after several update() calls equals compute() after one update() on everything."""
    one = make()
    one.update(*[sum((list(a[i]) for a in args_list), []) for i in range(len(args_list[0]))])
    split = make()
    start = 0
    for size in chunks:
        split.update(
            *[sum((list(a[i]) for a in args_list[start : start + size]), []) for i in range(len(args_list[0]))]
        )
        start += size
    for key, value in one.compute().items():
        torch.testing.assert_close(split.compute()[key], value, equal_nan=True)
    return _values(one.compute())


def test_region_grounding_hand_values():
    m = RegionGroundingMetrics("box")
    m.update([g for g, _ in GROUNDING], [p for _, p in GROUNDING])
    out = _values(m.compute())
    assert out["giou"] == pytest.approx((1 / 3 + 1 + 1 + 0 + 0) / 5)  # 7/15
    assert out["ciou"] == pytest.approx((50 + 100) / (150 + 100 + 0 + 50 + 100))  # 150 / 400 = 0.375
    assert out["n_acc"] == pytest.approx(1 / 2)  # one of two no-target samples rejected
    assert out["t_acc"] == pytest.approx(2 / 3)  # the unreadable answer is not an answer


def test_region_grounding_chunks_equal_one_shot():
    rows = [([g], [p]) for g, p in GROUNDING]
    out = _check_chunked(lambda: RegionGroundingMetrics("box"), rows, [2, 1, 2])
    assert out["giou"] == pytest.approx(7 / 15)


def test_region_grounding_masks_and_nan_when_nothing_counted():
    space = MaskSpace(grid=8)
    m = RegionGroundingMetrics(space)
    # 9 cells vs 9 cells overlapping in 4: IoU 4 / 14
    m.update([space.parse("2-4:1-3")], [space.parse("3-5:2-4")])
    out = _values(m.compute())
    assert out["giou"] == pytest.approx(2 / 7) and out["ciou"] == pytest.approx(2 / 7)
    assert math.isnan(out["n_acc"])  # no no-target sample: nan, not 0
    empty = RegionGroundingMetrics("box")
    assert all(math.isnan(v) for v in _values(empty.compute()).values())
    with pytest.raises(ValueError, match="one prediction per ground truth"):
        m.update([A], [])


def test_temporal_hand_values_and_chunks():
    m = TemporalGroundingMetrics()
    m.update([0.25, 0.5, 0.8, 0.1])
    out = _values(m.compute())
    assert out["tiou"] == pytest.approx((0.25 + 0.5 + 0.8 + 0.1) / 4)  # 0.4125
    assert out["r1@0.3"] == 0.5  # 0.5 and 0.8
    assert out["r1@0.5"] == 0.5  # >= 0.5 counts
    assert out["r1@0.7"] == 0.25
    chunked = _check_chunked(TemporalGroundingMetrics, [([v],) for v in [0.25, 0.5, 0.8, 0.1]], [1, 3])
    assert chunked == out
    m2 = TemporalGroundingMetrics()
    m2.update_regions([[(0, 2), (1, 3)]], [[(2, 4)]], IntervalSpace())  # merged gt (0, 3) vs (2, 4): 1 / 4
    assert float(m2.compute()["tiou"]) == pytest.approx(0.25)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        m2.update([1.5])


def test_spatio_temporal_hand_values():
    m = SpatioTemporalMetrics(tau=3.0, slot=0.5)
    gts = [[(1.0, A), (2.0, A)], [(1.0, A)], NO_TARGET]
    preds = [[(1.0, A), (2.0, HALF)], [(5.0, A)], NO_TARGET]
    # sample 1: same frames -> when 1; where (IoU 1 at t=1, 1/3 at t=2) / 2 = 2/3;
    #           Eq. 15: weights [[1, 1/3], [1, 1/3]], best matching 4/3 over 2 pairs, union 2 + 2 - 2 -> 2/3
    assert m.scores(gts[0], preds[0]) == pytest.approx((1.0, 2 / 3, 2 / 3))
    # sample 2: 4 s apart: disjoint slots (when 0), beyond tau (where 0, Eq. 15 0)
    assert m.scores(gts[1], preds[1]) == (0.0, 0.0, 0.0)
    # sample 3: a correct rejection scores 1 everywhere
    assert m.scores(gts[2], preds[2]) == (1.0, 1.0, 1.0)
    # a quarter-second offset: slots [0.75, 1.25] and [1.0, 1.5] overlap 0.25 over a union of 0.75 -> when 1/3
    assert m.scores([(1.0, A)], [(1.25, A)])[0] == pytest.approx(1 / 3)
    assert m.scores([(1.0, A)], None) == (0.0, 0.0, 0.0)
    # the first frame's slot is clipped to start at 0: [0, 0.25] vs [0, 0.5] -> 0.25 / 0.5 (unclipped, [-0.25, 0.25]
    # would be an invalid interval and score 0)
    assert m.scores([(0.0, A)], [(0.25, A)])[0] == pytest.approx(0.5)
    out = _check_chunked(lambda: SpatioTemporalMetrics(3.0, 0.5), [([g], [p]) for g, p in zip(gts, preds)], [1, 2])
    assert out["when"] == pytest.approx((1 + 0 + 1) / 3)
    assert out["where"] == pytest.approx((2 / 3 + 0 + 1) / 3)
    assert out["st"] == pytest.approx((2 / 3 + 0 + 1) / 3)


def test_locatability_hand_values():
    own = [0.9, 0.6, 0.2, 0.55, 0.3]
    other = [0.0, 0.7, 0.8, float("nan"), float("-inf")]
    # 1: own 0.9 > 0 -> located; 2: a look-alike scores higher (0.7 >= 0.6) -> confused; 3: confused;
    # 4: nan means no distractor -> located; 5: grounds nowhere -> neither
    out = _check_chunked(Locatability, [([o], [d]) for o, d in zip(own, other)], [2, 2, 1])
    assert out == {"locatability": pytest.approx(2 / 5), "confusion": pytest.approx(2 / 5)}
    with pytest.raises(ValueError, match="one distractor IoU per caption"):
        Locatability().update([0.5], [0.1, 0.2])


def test_locate_counts_one_caption_as_locatability_does():
    own = [0.9, 0.6, 0.2, 0.55, 0.3, 0.5]
    other = [0.0, 0.7, 0.8, float("nan"), float("-inf"), 0.5]
    for o, d in zip(own, other):
        m = Locatability()
        m.update([o], [d])
        assert locate(o, d) == (bool(m.located), bool(m.confused)), (o, d)
    assert locate(0.5, 0.5) == (False, True)  # a tie with a look-alike is a confusion, not a location


def test_locatability_from_regions():
    space = IntervalSpace()
    own, lookalikes = [(1.0, 2.0)], [[(4.0, 5.0)], [(6.0, 7.0)]]
    m = Locatability()
    # grounded to its own move; to a look-alike move (confused); half-way to its own (tIoU 1/3: neither)
    m.update_regions(
        space,
        [own, own, own],
        [lookalikes, lookalikes, lookalikes],
        [[(1.0, 2.0)], [(6.0, 7.0)], [(1.5, 2.5)]],
    )
    assert _values(m.compute()) == {"locatability": pytest.approx(1 / 3), "confusion": pytest.approx(1 / 3)}
    with pytest.raises(ValueError, match="one own region"):
        m.update_regions(space, [own], [], [own])


def test_reset_clears_state():
    m = Locatability()
    m.update([1.0], [0.0])
    m.reset()
    assert math.isnan(float(m.compute()["locatability"]))


def _rank_metrics(rank: int, world: int, init: str, out: str) -> None:
    """One rank of ``test_metrics_reduce_over_ranks``: the samples ``rank::world`` of each metric, then compute()."""
    import json

    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        values = {}
        for name, (make, args) in _RANKED.items():
            m = make()
            m.update(*[list(a)[rank::world] for a in args])
            values.update({f"{name}/{k}": float(v) for k, v in m.compute().items()})
        with open(f"{out}.{rank}", "w") as f:
            json.dump(values, f)
    finally:
        dist.destroy_process_group()


_RANKED = {
    "region": (lambda: RegionGroundingMetrics("box"), list(zip(*GROUNDING))),
    "temporal": (lambda: TemporalGroundingMetrics((0.3, 0.5)), [[0.1, 0.4, 0.6, 0.9, 1.0]]),
    "locatability": (Locatability, [[0.9, 0.6, 0.2, 0.55, 0.3], [0.0, 0.7, 0.8, float("nan"), 0.1]]),
}


@pytest.mark.slow
def test_metrics_reduce_over_ranks(tmp_path):
    """Under torch.distributed each rank's compute() sums every rank's states, so two ranks holding half the samples
    each report the one-process value (the states are created and updated on the metric's device, as NCCL needs)."""
    import json

    import torch.multiprocessing as mp

    out = str(tmp_path / "rank")
    mp.spawn(_rank_metrics, args=(2, f"file://{tmp_path / 'store'}", out), nprocs=2, join=True)
    one = {}
    for name, (make, args) in _RANKED.items():
        m = make()
        m.update(*args)
        one.update({f"{name}/{k}": float(v) for k, v in m.compute().items()})
    for rank in range(2):
        got = json.loads((tmp_path / f"rank.{rank}").read_text())
        assert got.keys() == one.keys()
        for k, v in one.items():
            assert got[k] == pytest.approx(v, nan_ok=True), (rank, k)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_metrics_update_on_a_cuda_device():
    """Moved to the GPU (``.to(module.device)``, as CycleGRPO's evaluation does), every metric updates and computes
    there: NCCL can only reduce CUDA states."""
    for make, args in _RANKED.values():
        m, cpu = make().to("cuda"), make()
        m.update(*args)
        cpu.update(*args)
        assert all(v.device.type == "cuda" for v in m.metric_state.values())
        for k, v in cpu.compute().items():
            torch.testing.assert_close(m.compute()[k].cpu(), v, equal_nan=True)
