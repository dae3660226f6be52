"""Region spaces for CycleGRPO: serializer + bounded consistency, one class per geometry (docs/cycle_grpo.md).

Pure Python / numpy: no Lightning, no torch, no I/O. ``REGION_SPACES`` maps a config name to its class;
``region_space("interval", duration=8.0)`` builds one with a clear error for an unknown name.
"""

from __future__ import annotations

from typing import Any

from core.regions import checks
from core.regions.anchors import AnchorSpace, max_weight_matching
from core.regions.base import NO_TARGET, NO_TARGET_TEXT, NoTarget, RegionSpace, says_no_target
from core.regions.boxes import BoxSpace, box_iou
from core.regions.checks import *  # noqa: F403 - the Phi checks and reward helpers (checks.__all__)
from core.regions.intervals import IntervalSpace, merge_intervals, merged_overlap
from core.regions.masks import MaskSpace

REGION_SPACES: dict[str, type[RegionSpace]] = {
    "box": BoxSpace,
    "mask": MaskSpace,
    "interval": IntervalSpace,
    "anchor": AnchorSpace,
}


def region_space(name: str, **kwargs: Any) -> RegionSpace:
    """An instance of the space registered as ``name`` (kwargs go to its constructor)."""
    if name not in REGION_SPACES:
        raise ValueError(f"unknown region space {name!r}; choose one of {tuple(REGION_SPACES)}")
    return REGION_SPACES[name](**kwargs)


__all__ = [
    *checks.__all__,
    "AnchorSpace",
    "BoxSpace",
    "IntervalSpace",
    "MaskSpace",
    "NO_TARGET",
    "NO_TARGET_TEXT",
    "NoTarget",
    "REGION_SPACES",
    "RegionSpace",
    "box_iou",
    "max_weight_matching",
    "merge_intervals",
    "merged_overlap",
    "region_space",
    "says_no_target",
]
