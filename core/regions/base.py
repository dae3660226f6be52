"""The region-space interface of CycleGRPO: a serializer (text <-> region) and a bounded consistency function.

Generalized CycleGRPO (paper 004) abstracts a region as an element R of a space Omega that only has to offer

- a *serializer*, so the policy can read a region in its captioning prompt and write one as its grounding answer:
  ``serialize(region) -> str`` and ``parse(text) -> region | NO_TARGET | None``;
- a *consistency* ``S(R, R^) in [0, 1]`` (the reconstruction overlap): IoU for boxes and masks, tIoU after merging
  for intervals (Eq. 14), matched support overlap for (timestamp, box) anchors (Eq. 15).

Every space here writes its consistency as ``intersection / union`` of one ``overlap(gt, pred)`` call, so the same
numbers feed the reward (per-sample ratio) and the cumulative metrics (cIoU sums intersections and unions).

**No target** (GRES-style). The grounding side may answer that nothing matches: ``NO_TARGET``, written
``NO_TARGET_TEXT`` ("no target"). The rules, the same for every space:

====================  ====================  ===========
ground truth          prediction            consistency
====================  ====================  ===========
NO_TARGET             NO_TARGET             1 (a correct rejection)
NO_TARGET             a region              0 (a false alarm)
a region              NO_TARGET             0 (a miss)
anything              None (unreadable)     0
====================  ====================  ===========

An *empty* region (an all-zero mask, an interval list with no valid interval) is normalised to ``NO_TARGET`` by
``parse`` and by the constructors, so "empty" and "no target" are one value and the table above covers both.
``parse`` never raises on arbitrary text: a region wins over a no-target phrase when the text holds both (the answer
committed to a region), and text with neither is ``None``.
"""

from __future__ import annotations

import math
import re
from abc import ABC, abstractmethod
from typing import Any, ClassVar

__all__ = ["NO_TARGET", "NO_TARGET_TEXT", "NUM", "NoTarget", "RegionSpace", "finite_float", "says_no_target"]


class NoTarget:
    """The answer "no such region" (a singleton: compare with ``is NO_TARGET``)."""

    _instance: NoTarget | None = None

    def __new__(cls) -> NoTarget:
        if cls._instance is None:
            cls._instance = super().__new__(cls)
        return cls._instance

    def __repr__(self) -> str:
        return "NO_TARGET"

    def __reduce__(self) -> str:  # pickles (DataLoader workers, checkpoints) as the same singleton
        return "NO_TARGET"


NO_TARGET = NoTarget()
NO_TARGET_TEXT = "no target"
"""The canonical serialization of ``NO_TARGET`` in every space."""

NUM = r"(?<![\d.])[-+]?(?:\d{1,16}(?:\.\d{0,16})?|\.\d{1,16})(?:[eE][-+]?\d{1,3})?(?!\d)"
"""A decimal number as a model writes it (no thousands separators). Digit runs are bounded and a number may not
start inside another, so a runaway completion of digits is scanned in linear time, not quadratic."""

_NO_TARGET_RE = re.compile(
    r"\bno[ _-]?target\b|\bno such (?:region|object|event|moment|thing)\b|\bnot (?:present|found|visible|in the)\b"
    r"|\bdoes not (?:exist|appear|happen|occur)\b|\bnone\b|\bnull\b",
    re.IGNORECASE,
)
_MAX_TEXT = 20_000
"""Characters of a model's text that ``parse`` reads (a runaway completion must not make the reward slow)."""


def finite_float(text: str) -> float | None:
    """``float(text)`` if it is finite, else None (no exception on overflow or junk)."""
    try:
        value = float(text)
    except (ValueError, OverflowError):
        return None
    return value if math.isfinite(value) else None


def says_no_target(text: str) -> bool:
    """Whether ``text`` answers "no such region" (``NO_TARGET_TEXT`` or a close phrasing: "none", "not present")."""
    return bool(_NO_TARGET_RE.search(text))


class RegionSpace(ABC):
    """A region space: serializer + bounded consistency. Subclasses implement ``_serialize``, ``_parse`` and
    ``_overlap`` for real regions; this class owns ``NO_TARGET``, unreadable answers and the text-length cap."""

    name: ClassVar[str] = ""
    """Key in ``REGION_SPACES`` and in log names (``cycle/s/<name>``)."""

    # --- serializer -----------------------------------------------------------------------------------------------

    def serialize(self, region: Any) -> str:
        """The canonical text of ``region`` (``NO_TARGET_TEXT`` for ``NO_TARGET``); ``parse`` inverts it."""
        if region is NO_TARGET:
            return NO_TARGET_TEXT
        region = self.normalize(region)
        return NO_TARGET_TEXT if region is NO_TARGET else self._serialize(region)

    def parse(self, text: Any) -> Any:
        """The region written in ``text``, ``NO_TARGET`` for a no-target answer, or None when nothing is readable.

        Never raises: non-strings, empty strings and junk give None; only the first ``_MAX_TEXT`` characters are read.
        """
        if not isinstance(text, str) or not text.strip():
            return None
        text = text[:_MAX_TEXT]
        try:
            region = self._parse(text)
        except (ValueError, OverflowError, IndexError, RecursionError, MemoryError):  # pragma: no cover - guard rail
            region = None
        if region is not None:
            return self.normalize(region)
        return NO_TARGET if says_no_target(text) else None

    def normalize(self, region: Any) -> Any:
        """The canonical value of a region (``NO_TARGET`` for an empty one). Raises ValueError on a malformed region
        given by code (labels); model text never reaches here unparsed."""
        return region

    # --- consistency ----------------------------------------------------------------------------------------------

    def overlap(self, gt: Any, pred: Any) -> tuple[float, float]:
        """``(intersection, union)`` of two regions in the space's measure (pixels, grid cells, seconds, anchors).

        ``NO_TARGET`` and None count as the empty region here (so a miss adds the ground truth to the union, and a
        false alarm the prediction); use ``consistency`` for the no-target rules.
        """
        gt = NO_TARGET if gt is None else self.normalize(gt)
        pred = NO_TARGET if pred is None else self.normalize(pred)
        if gt is NO_TARGET and pred is NO_TARGET:
            return 0.0, 0.0
        if gt is NO_TARGET:
            return 0.0, self.measure(pred)
        if pred is NO_TARGET:
            return 0.0, self.measure(gt)
        inter, union = self._overlap(gt, pred)
        return float(inter), float(union)

    def consistency(self, gt: Any, pred: Any) -> float:
        """``S(gt, pred) in [0, 1]``: ``intersection / union``, with the no-target table of the module docstring."""
        if pred is None:
            return 0.0
        gt, pred = self.normalize(gt), self.normalize(pred)
        if gt is NO_TARGET or pred is NO_TARGET:
            return 1.0 if (gt is NO_TARGET and pred is NO_TARGET) else 0.0
        inter, union = self._overlap(gt, pred)
        if not union > 0.0:  # two degenerate regions (zero-area boxes): nothing overlaps
            return 0.0
        return float(min(max(inter / union, 0.0), 1.0))

    def measure(self, region: Any) -> float:
        """The size of a region (its overlap with itself)."""
        return self.overlap(region, region)[1]

    # --- for subclasses -------------------------------------------------------------------------------------------

    @abstractmethod
    def _serialize(self, region: Any) -> str: ...

    @abstractmethod
    def _parse(self, text: str) -> Any:
        """A region or None; may return an empty region (``normalize`` maps it to ``NO_TARGET``)."""

    @abstractmethod
    def _overlap(self, gt: Any, pred: Any) -> tuple[float, float]:
        """``(intersection, union)`` of two normalised, non-empty regions."""
