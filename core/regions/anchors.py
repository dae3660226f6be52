"""Spatio-temporal anchors: (timestamp, box) pairs; consistency = matched support overlap (paper 004, Eq. 15).

A spatio-temporal region is the evidence "when + where" as a tuple of anchors ``(t, [x1, y1, x2, y2])`` (seconds,
pixels of the model input), as Open-o3-Video's grounded answers. Eq. 15 in this project's reading:

1. weight every (ground-truth anchor a, predicted anchor b) pair by the overlap of their supports,
   ``w_ab = IoU(box_a, box_b)`` if ``|t_a - t_b| <= tau`` else 0 (tau = 3 s in the paper);
2. take a **maximum-weight one-to-one matching** M (an exact assignment, not greedy: see the tests for a case where
   greedy takes the best single pair and loses the second one);
3. a pair of weight 0 is not a match: its two anchors stay unmatched;
4. ``S_ST = sum_{(a, b) in M} w_ab / (|M| + unmatched ground truth + unmatched predictions)
   = sum_M w_ab / (|R| + |R^| - |M|)``: each matched pair is one "support" whose overlap is its IoU, and every
   unmatched anchor adds a whole support to the union with nothing to the intersection.

So the right object at the wrong time (``|dt| > tau``) and the right time with the wrong box both add nothing to the
intersection and still enlarge the union, and extra anchors cost score. The paper's text only says "maximum-weight
one-to-one matching of support overlaps, pairs more than tau apart weighted zero, unmatched anchors counted in the
union"; the normalisation by anchor counts (rather than by box areas) is our choice, recorded in docs/decisions.md.

Written ``1.5s: [10, 20, 50, 60]; 2.0s: [12, 20, 52, 60]`` (one decimal); ``parse`` also reads
``{"time": 1.5, "bbox_2d": [...]}`` objects, ``1.5 @ [..]``, ``[..] at 1.5s`` and Open-o3-Video's
``<box>[..]</box>at<t>1.5</t>s``. The matching is an exact Hungarian algorithm in pure
Python (anchor lists have tens of entries; no SciPy at run time; the tests check it against SciPy's).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from typing import Any

from core.regions.base import NO_TARGET, NUM, RegionSpace, finite_float
from core.regions.boxes import box_iou

__all__ = ["Anchor", "AnchorSpace", "anchor_weights", "max_weight_matching"]

Anchor = tuple[float, tuple[float, float, float, float]]
_BOX = rf"[\[(]\s*({NUM})\s*,\s*({NUM})\s*,\s*({NUM})\s*,\s*({NUM})\s*[\])]"
_SECONDS = r"(?:s|sec|secs|seconds)\b"
_ANCHOR_RES = [  # (pattern, True when the time comes first)
    # 1.5s: [..], 1.5 @ [..]
    (re.compile(rf"({NUM})\s*(?:{_SECONDS}\s*[:@,]?|[:@])\s*{_BOX}", re.IGNORECASE), True),
    # {"time": 1.5, "bbox_2d": [..]}
    (
        re.compile(
            rf"[\"']?(?:time|timestamp|t)[\"']?\s*:\s*({NUM})\s*s?[\"']?\s*,\s*"
            rf"[\"']?(?:bbox_2d|bbox|box)[\"']?\s*:\s*{_BOX}",
            re.IGNORECASE,
        ),
        True,
    ),
    # [..] at 1.5s, and Open-o3-Video's <box>[..]</box>at<t>1.5</t>s
    (re.compile(rf"{_BOX}\s*(?:</box>)?\s*(?:\bat\b|@)\s*(?:<t>)?\s*({NUM})", re.IGNORECASE), False),
]


def max_weight_matching(weights: Sequence[Sequence[float]]) -> list[tuple[int, int]]:
    """Maximum-weight one-to-one matching of a ``[n, m]`` weight matrix -> ``(row, col)`` pairs with weight > 0.

    The Hungarian algorithm (shortest augmenting paths with potentials, O(n^2 m)) on cost ``-w``; a rectangular
    matrix assigns every row of the smaller side. Pairs of weight <= 0 are dropped from the result (an assignment may
    pair them only because every row must be assigned). Sorted by row.
    """
    n = len(weights)
    m = len(weights[0]) if n else 0
    if n == 0 or m == 0:
        return []
    if n > m:
        return sorted((i, j) for j, i in max_weight_matching([list(col) for col in zip(*weights)]))
    cost = [[-float(w) for w in row] for row in weights]
    inf = math.inf
    u, v = [0.0] * (n + 1), [0.0] * (m + 1)
    owner, way = [0] * (m + 1), [0] * (m + 1)  # owner[j]: 1-based row assigned to column j (0: free)
    for i in range(1, n + 1):
        owner[0], j0 = i, 0
        minv, used = [inf] * (m + 1), [False] * (m + 1)
        while True:
            used[j0] = True
            i0, delta, j1 = owner[j0], inf, 0
            for j in range(1, m + 1):
                if not used[j]:
                    cur = cost[i0 - 1][j - 1] - u[i0] - v[j]
                    if cur < minv[j]:
                        minv[j], way[j] = cur, j0
                    if minv[j] < delta:
                        delta, j1 = minv[j], j
            for j in range(m + 1):
                if used[j]:
                    u[owner[j]] += delta
                    v[j] -= delta
                else:
                    minv[j] -= delta
            j0 = j1
            if owner[j0] == 0:
                break
        while j0:  # flip the augmenting path
            j1 = way[j0]
            owner[j0] = owner[j1]
            j0 = j1
    pairs = [(owner[j] - 1, j - 1) for j in range(1, m + 1) if owner[j]]
    return sorted((i, j) for i, j in pairs if weights[i][j] > 0)


def anchor_weights(gt: Sequence[Anchor], pred: Sequence[Anchor], tau: float) -> list[list[float]]:
    """``[len(gt), len(pred)]`` support overlaps: box IoU, 0 for pairs more than ``tau`` seconds apart."""
    return [[box_iou(ba, bb) if abs(ta - tb) <= tau else 0.0 for tb, bb in pred] for ta, ba in gt]


class AnchorSpace(RegionSpace):
    """(timestamp, box) anchors scored by Eq. 15 (module docstring). ``tau``: the time gate in seconds."""

    name = "anchor"

    def __init__(self, tau: float = 3.0, decimals: int = 1):
        if not tau >= 0:
            raise ValueError(f"AnchorSpace(tau=...) is a time gate in seconds and must be >= 0, got {tau}")
        self.tau, self.decimals = float(tau), decimals

    def normalize(self, region: Any) -> Any:
        if region is NO_TARGET:
            return region
        try:
            anchors = tuple((float(t), tuple(float(v) for v in box)) for t, box in region)
        except (TypeError, ValueError):
            raise ValueError(
                f"an anchor region is a list of (seconds, [x1, y1, x2, y2]) pairs or NO_TARGET, got {region!r}"
            ) from None
        if any(len(box) != 4 for _, box in anchors):
            raise ValueError(f"every anchor's box needs 4 coordinates [x1, y1, x2, y2], got {region!r}")
        return anchors if anchors else NO_TARGET

    def _serialize(self, region: tuple[Anchor, ...]) -> str:
        d = self.decimals
        return "; ".join(f"{t:.{d}f}s: [" + ", ".join(str(int(round(v))) for v in box) + "]" for t, box in region)

    def _parse(self, text: str) -> tuple[Anchor, ...] | None:
        found: list[tuple[int, int, Anchor]] = []  # (start, end, anchor) of every match of every form
        for pattern, time_first in _ANCHOR_RES:
            for match in pattern.finditer(text):
                values = [finite_float(g) for g in match.groups()]
                if any(v is None for v in values):
                    continue
                t, box = (values[0], values[1:]) if time_first else (values[4], values[:4])
                found.append((match.start(), match.end(), (t, tuple(box))))
        out, end = [], -1
        for start, stop, anchor in sorted(found, key=lambda f: (f[0], -f[1])):
            if start >= end:  # in text order; a span already read by another form is not read twice
                out.append(anchor)
                end = stop
        return tuple(out) if out else None

    def match(self, gt: Any, pred: Any) -> list[tuple[int, int, float]]:
        """The Eq. 15 matching: ``(gt index, pred index, weight)`` for every matched pair (weight > 0)."""
        gt, pred = self.normalize(gt), self.normalize(pred)
        if gt is NO_TARGET or pred is NO_TARGET:
            return []
        w = anchor_weights(gt, pred, self.tau)
        return [(i, j, w[i][j]) for i, j in max_weight_matching(w)]

    def _overlap(self, gt: tuple[Anchor, ...], pred: tuple[Anchor, ...]) -> tuple[float, float]:
        matched = self.match(gt, pred)
        return sum(w for _, _, w in matched), float(len(gt) + len(pred) - len(matched))
