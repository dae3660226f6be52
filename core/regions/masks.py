"""Masks on a coarse grid, written as row bands; consistency = mask IoU on the grid.

The papers' masks are SAMTok tokens (two VQ codes decoded by SAM2), which this project does not have. The
serialization here is text a tiny model can learn from the box format it already writes:

- the image is divided into a ``grid x grid`` lattice of cells (default 32: 7 px cells on a 224 px toy image, so a
  small toy shape, 18-27 px, spans 3-4 cells and a large one, 43-60 px, 6-9);
- a mask is a list of **row bands** ``r1-r2:c1-c2,c3-c4`` (inclusive cell indices): rows ``r1..r2`` all hold the same
  column spans; consecutive rows with identical spans are merged into one band, bands are separated by ``;``, and a
  single row or column is written as one number (``7:3-5``).

Why this form. A rectangle is exactly one band, ``y1-y2:x1-x2``, i.e. the box answer in other units, so a model that
grounds with boxes starts one step away; each band is local (a row range and where the object is on it), unlike
COCO's run-length counts, which are cumulative so one wrong count shifts every pixel after it; one unreadable band
costs that band only; and the length grows with the outline's complexity, not with the area (large toy
shapes are 4-9 bands, 34-68 characters, on the 32 grid). Polygons were the alternative: they need a winding order and a rasteriser
convention, and a self-intersecting polygon has no agreed area.

Rasterisation (``from_pixels``): a pixel belongs to the cell its centre falls in; a cell is on when at least half of
its pixels are on; a non-empty mask that turns on no cell keeps its best-covered cell, so a present object never
becomes "no target". ``to_pixels`` is the inverse lattice map (nearest cell), for scoring against full-resolution
masks. The reward compares grid masks: it measures what the model can express.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

from core.regions.base import NO_TARGET, RegionSpace

__all__ = ["MaskSpace"]

_RANGE = r"\d{1,6}(?:\s*-\s*\d{1,6})?"
_BAND_RE = re.compile(rf"(\d{{1,6}})(?:\s*-\s*(\d{{1,6}}))?\s*:\s*({_RANGE}(?:\s*,\s*{_RANGE})*)")
_SPAN_RE = re.compile(r"(\d{1,6})(?:\s*-\s*(\d{1,6}))?")


def _runs(row: np.ndarray) -> tuple[tuple[int, int], ...]:
    """Inclusive (start, end) column runs of a bool row."""
    padded = np.concatenate([[False], row, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(padded))
    return tuple((int(a), int(b) - 1) for a, b in zip(edges[::2], edges[1::2]))


def _fmt(a: int, b: int) -> str:
    return str(a) if a == b else f"{a}-{b}"


class MaskSpace(RegionSpace):
    """A mask region is a read-only bool array ``[grid, grid]`` (row = y). See the module docstring for the text."""

    name = "mask"

    def __init__(self, grid: int = 32):
        if not 2 <= grid <= 256:
            raise ValueError(f"MaskSpace(grid=...) must lie in [2, 256] cells per side, got {grid}")
        self.grid = grid

    def normalize(self, region: Any) -> Any:
        if region is NO_TARGET:
            return region
        arr = np.asarray(region)
        if arr.shape != (self.grid, self.grid):
            raise ValueError(
                f"a mask region of MaskSpace(grid={self.grid}) is a [{self.grid}, {self.grid}] array, got shape "
                f"{arr.shape}; rasterise pixel masks with MaskSpace.from_pixels"
            )
        arr = arr.astype(bool)
        if not arr.any():
            return NO_TARGET
        arr.setflags(write=False)
        return arr

    def _serialize(self, region: np.ndarray) -> str:
        bands: list[str] = []
        prev: tuple | None = None
        start = 0
        rows = [_runs(region[r]) for r in range(self.grid)] + [()]
        for r, runs in enumerate(rows):
            if runs != prev:
                if prev:
                    bands.append(f"{_fmt(start, r - 1)}:" + ",".join(_fmt(a, b) for a, b in prev))
                prev, start = runs, r
        return ";".join(bands)

    def _parse(self, text: str) -> np.ndarray | None:
        out = np.zeros((self.grid, self.grid), dtype=bool)
        found = False
        top = self.grid - 1
        for band in _BAND_RE.finditer(text):
            r1 = int(band.group(1))
            r2 = int(band.group(2)) if band.group(2) is not None else r1
            r1, r2 = sorted((min(r1, top), min(r2, top)))
            for span in _SPAN_RE.finditer(band.group(3)):
                c1 = int(span.group(1))
                c2 = int(span.group(2)) if span.group(2) is not None else c1
                c1, c2 = sorted((min(c1, top), min(c2, top)))
                out[r1 : r2 + 1, c1 : c2 + 1] = True
                found = True
        return out if found else None

    def _overlap(self, gt: np.ndarray, pred: np.ndarray) -> tuple[float, float]:
        return float(np.count_nonzero(gt & pred)), float(np.count_nonzero(gt | pred))

    # --- pixels <-> grid ------------------------------------------------------------------------------------------

    def from_pixels(self, mask: Any) -> Any:
        """Rasterise a pixel mask ``[H, W]`` to the grid (module docstring); an empty mask is ``NO_TARGET``."""
        mask = np.asarray(mask, dtype=bool)
        if mask.ndim != 2 or min(mask.shape) < 1:
            raise ValueError(f"from_pixels takes a 2-D [H, W] mask, got shape {mask.shape}")
        if not mask.any():
            return NO_TARGET
        h, w = mask.shape
        rows = (np.arange(h) * 2 + 1) * self.grid // (2 * h)  # cell of each pixel centre
        cols = (np.arange(w) * 2 + 1) * self.grid // (2 * w)
        on = np.zeros((self.grid, self.grid), dtype=np.int64)
        total = np.zeros((self.grid, self.grid), dtype=np.int64)
        np.add.at(on, (rows[:, None], cols[None, :]), mask.astype(np.int64))
        np.add.at(total, (rows[:, None], cols[None, :]), 1)
        cover = np.divide(on, total, out=np.zeros(on.shape), where=total > 0)
        cells = cover >= 0.5
        if not cells.any():
            cells[np.unravel_index(int(np.argmax(cover)), cover.shape)] = True
        return self.normalize(cells)

    def to_pixels(self, region: Any, height: int, width: int) -> np.ndarray:
        """The pixel mask ``[height, width]`` of a grid region (all False for ``NO_TARGET``)."""
        region = self.normalize(region)
        if region is NO_TARGET:
            return np.zeros((height, width), dtype=bool)
        rows = (np.arange(height) * 2 + 1) * self.grid // (2 * height)
        cols = (np.arange(width) * 2 + 1) * self.grid // (2 * width)
        return region[rows[:, None], cols[None, :]]

    def from_box(self, box: Any, height: int, width: int) -> Any:
        """The grid mask of a pixel box ``[x1, y1, x2, y2]`` on a ``height x width`` image (pixels x1 <= x < x2)."""
        x1, y1, x2, y2 = (int(round(float(v))) for v in box)
        mask = np.zeros((height, width), dtype=bool)
        mask[max(y1, 0) : max(y2, 0), max(x1, 0) : max(x2, 0)] = True
        return self.from_pixels(mask)
