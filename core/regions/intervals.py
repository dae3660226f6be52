"""Temporal intervals in seconds; consistency = tIoU after merging each side's intervals (paper 004, Eq. 14).

A temporal region is a tuple of ``(start, end)`` pairs in seconds. Eq. 14 compares the *unions*: each side's
intervals are merged into disjoint ones first, so an answer that lists one moment twice, or splits it in two
touching halves, covers the same time and scores the same; ``tIoU = |U(R) n U(R^)| / |U(R) u U(R^)|`` in seconds.

Written ``[2.5, 4.0]``, several as ``[2.5, 4.0], [6.0, 7.5]`` (one decimal). ``parse`` also reads ``2.5-4.0``,
``2.5 s - 4.0 s`` and ``from 2.5 to 4.0 seconds``. It keeps what is written, valid or not: an interval with
``end <= start``, a negative start, or (when the space knows the clip's duration) a start at or after the end of the
clip is *invalid*; invalid intervals never count in the overlap, and ``n_invalid`` counts them for the temporal
gate of ``checks.invalid_interval_gate``. Valid intervals are clipped to ``[0, duration]``.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from core.regions.base import NO_TARGET, NUM, RegionSpace, finite_float

__all__ = ["Interval", "IntervalSpace", "interval_length", "merge_intervals", "merged_overlap"]

Interval = tuple[float, float]
_UNIT = r"(?:\s*(?:s|sec|secs|second|seconds)\b)?"
_PAIR_RE = re.compile(
    rf"\[\s*({NUM})\s*,\s*({NUM})\s*\]"  # [a, b]
    rf"|\bfrom\s+({NUM}){_UNIT}\s+(?:to|until|till)\s+({NUM})"  # from a to b
    rf"|({NUM}){_UNIT}\s*(?:-|–|—|\bto\b)\s*({NUM})",  # a - b, a s - b s, a to b
    re.IGNORECASE,
)


def merge_intervals(intervals: Sequence[Sequence[float]]) -> list[Interval]:
    """Sorted, disjoint union of intervals (overlapping or touching ones merge); empty ones are dropped."""
    out: list[list[float]] = []
    for s, e in sorted((float(s), float(e)) for s, e in intervals if e > s):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def interval_length(intervals: Sequence[Sequence[float]]) -> float:
    return sum(e - s for s, e in merge_intervals(intervals))


def merged_overlap(a: Sequence[Sequence[float]], b: Sequence[Sequence[float]]) -> tuple[float, float]:
    """``(|U(a) n U(b)|, |U(a) u U(b)|)`` in seconds after merging each side (Eq. 14's numerator and denominator)."""
    ma, mb = merge_intervals(a), merge_intervals(b)
    inter, i, j = 0.0, 0, 0
    while i < len(ma) and j < len(mb):  # sweep two sorted disjoint lists
        lo, hi = max(ma[i][0], mb[j][0]), min(ma[i][1], mb[j][1])
        inter += max(hi - lo, 0.0)
        if ma[i][1] < mb[j][1]:
            i += 1
        else:
            j += 1
    union = sum(e - s for s, e in ma) + sum(e - s for s, e in mb) - inter
    return inter, union


class IntervalSpace(RegionSpace):
    """Temporal intervals (module docstring). ``duration`` (seconds, optional) bounds valid intervals."""

    name = "interval"

    def __init__(self, duration: float | None = None, decimals: int = 1):
        if duration is not None and not duration > 0:
            raise ValueError(f"IntervalSpace(duration=...) must be > 0 seconds or None, got {duration}")
        self.duration, self.decimals = duration, decimals

    def with_duration(self, duration: float | None) -> IntervalSpace:
        """The same space bounded by one clip's duration (clips differ in length; the space is cheap to copy)."""
        return IntervalSpace(duration, self.decimals)

    def is_valid(self, interval: Sequence[float]) -> bool:
        s, e = interval
        return 0.0 <= s < e and (self.duration is None or s < self.duration)

    def n_invalid(self, region: Any) -> int:
        """How many written intervals are invalid (0 for ``NO_TARGET`` and None)."""
        if region is None or region is NO_TARGET:
            return 0
        return sum(not self.is_valid(iv) for iv in region)

    def valid(self, region: Any) -> list[Interval]:
        """The valid intervals of a region, clipped to the clip."""
        if region is None or region is NO_TARGET:
            return []
        end = self.duration if self.duration is not None else float("inf")
        return [(s, min(e, end)) for s, e in region if self.is_valid((s, e))]

    def normalize(self, region: Any) -> Any:
        if region is NO_TARGET:
            return region
        try:
            pairs = tuple((float(s), float(e)) for s, e in region)
        except (TypeError, ValueError):
            raise ValueError(
                f"an interval region is a list of (start, end) pairs in seconds or NO_TARGET, got {region!r}"
            ) from None
        return pairs if pairs else NO_TARGET

    def _serialize(self, region: tuple[Interval, ...]) -> str:
        d = self.decimals
        return ", ".join(f"[{s:.{d}f}, {e:.{d}f}]" for s, e in region)

    def _parse(self, text: str) -> tuple[Interval, ...] | None:
        out = []
        for match in _PAIR_RE.finditer(text):
            groups = [g for g in match.groups() if g is not None]
            s, e = finite_float(groups[0]), finite_float(groups[1])
            if s is not None and e is not None:
                out.append((s, e))
        return tuple(out) if out else None

    def _overlap(self, gt: Any, pred: Any) -> tuple[float, float]:
        return merged_overlap(self.valid(gt), self.valid(pred))
