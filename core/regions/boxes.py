"""Boxes: one ``[x1, y1, x2, y2]`` in pixels of the model input, consistency = IoU (the spatial space of the
ECCV CycleGRPO's continuous-box ablation, Table 6 of paper 004)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from core.regions.base import NO_TARGET, NUM, RegionSpace, finite_float

__all__ = ["Box", "BoxSpace", "box_area", "box_intersection", "box_iou"]

Box = tuple[float, float, float, float]
_BOX_RE = re.compile(rf"[\[(]\s*({NUM})\s*,\s*({NUM})\s*,\s*({NUM})\s*,\s*({NUM})\s*[\])]")


def box_area(b: Sequence[float]) -> float:
    """Area of ``[x1, y1, x2, y2]``; 0 for a degenerate or inverted box (continuous coordinates, no +1)."""
    return max(b[2] - b[0], 0.0) * max(b[3] - b[1], 0.0)


def box_intersection(a: Sequence[float], b: Sequence[float]) -> float:
    return max(min(a[2], b[2]) - max(a[0], b[0]), 0.0) * max(min(a[3], b[3]) - max(a[1], b[1]), 0.0)


def box_iou(a: Sequence[float], b: Sequence[float]) -> float:
    """IoU of two boxes; 0 when the union is empty (two degenerate boxes)."""
    inter = box_intersection(a, b)
    union = box_area(a) + box_area(b) - inter
    return inter / union if union > 0 else 0.0


class BoxSpace(RegionSpace):
    """One axis-aligned box per region, written ``[x1, y1, x2, y2]`` with integer pixels (Qwen2.5-VL's absolute
    coordinates on the resized input, as the project's REC answers).

    ``parse`` reads the first ``[a, b, c, d]`` (or ``(a, b, c, d)``) of four finite numbers, so VLM-R1's
    ``{"bbox_2d": [...]}`` JSON works too; a box with ``x2 <= x1`` or ``y2 <= y1`` is still a box (it scores 0), so a
    sloppy answer is told apart from an unreadable one. Rescaling to original pixels is the caller's job, as for the
    REC reward. Multi-object targets belong to the mask space.
    """

    name = "box"

    def normalize(self, region: Any) -> Any:
        if region is NO_TARGET:
            return region
        try:
            values = tuple(float(v) for v in region)
        except (TypeError, ValueError):
            raise ValueError(f"a box region is [x1, y1, x2, y2] (4 numbers) or NO_TARGET, got {region!r}") from None
        if len(values) != 4:
            raise ValueError(f"a box region is [x1, y1, x2, y2] (4 numbers) or NO_TARGET, got {region!r}")
        return values

    def _serialize(self, region: Box) -> str:
        return "[" + ", ".join(str(int(round(v))) for v in region) + "]"

    def _parse(self, text: str) -> Box | None:
        for match in _BOX_RE.finditer(text):
            values = [finite_float(g) for g in match.groups()]
            if all(v is not None for v in values):
                return tuple(values)  # type: ignore[return-value]
        return None

    def _overlap(self, gt: Box, pred: Box) -> tuple[float, float]:
        inter = box_intersection(gt, pred)
        return inter, box_area(gt) + box_area(pred) - inter
