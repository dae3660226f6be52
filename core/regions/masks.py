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

**Mask tokens** (``MaskSpace(codec=...)``, CycleGRPO's own form, docs/mask_tokens.md). Given a mask tokenizer (any
object with ``encode(image, mask, box=None) -> (c1, c2)`` and ``decode(codes, image) -> bool [H, W]``, the
``MaskCodec`` protocol; ``lightning_modules.models.mask_tokenizer`` has two), a region is a bool *pixel* mask of the
image and its text is mask tokens (``core.regions.mask_tokens``): ``<|mt_start|><|mt_0017|><|mt_0300|><|mt_end|>``.
Encoding and decoding need the image, so a token-mode space is bound to one sample's image with
``space.for_image(image)`` (a cheap copy with its own decode cache: the K groundings of one caption often repeat
codes). Then

- ``serialize(mask)`` is one span (the tokenizer's two codes for the mask, prompted with its tight box);
  ``serialize_objects([m1, m2])`` one span per object, as the released model answers multi-object queries;
- ``parse(text)`` decodes every well-formed span (``mask_tokens.parse_masks``: malformed spans are skipped) and
  returns the union of the decoded masks; no span: ``NO_TARGET`` for a no-target phrase, else None; spans that
  decode to nothing are an empty region, i.e. ``NO_TARGET`` (as every empty region);
- ``codes(text)`` is the raw code pairs, for rewards that compare codes rather than masks;
- consistency is pixel IoU; ``from_pixels`` / ``to_pixels`` are the identity on pixel masks.

The reward's ceiling in this mode is the tokenizer's round-trip IoU (a perfect grounder writes the ground truth's own
codes, which decode to an approximation of it): experiments/mask_tokenizer.md measures it for the toy tokenizer.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Sequence
from typing import Any, Protocol, runtime_checkable

import numpy as np

from core.regions.base import NO_TARGET, RegionSpace
from core.regions.mask_tokens import format_mask, parse_masks

__all__ = ["MaskCodec", "MaskSpace"]


@runtime_checkable
class MaskCodec(Protocol):
    """What the token mode needs of a mask tokenizer (``lightning_modules.models.mask_tokenizer.base``)."""

    def encode(self, image: Any, mask: Any, box: Sequence[float] | None = None) -> tuple[int, int]: ...

    def decode(self, codes: Sequence[int], image: Any) -> np.ndarray: ...


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
    """A mask region is a read-only bool array: ``[grid, grid]`` (row = y) in grid mode, ``[H, W]`` pixels of the
    bound image in token mode (``codec`` given). See the module docstring for both texts."""

    name = "mask"
    DECODE_CACHE = 4096
    """Decoded masks a bound token-mode space keeps (by code pair)."""

    def __init__(self, grid: int = 32, codec: MaskCodec | None = None, image: Any = None):
        if not 2 <= grid <= 256:
            raise ValueError(f"MaskSpace(grid=...) must lie in [2, 256] cells per side, got {grid}")
        if codec is not None and not isinstance(codec, MaskCodec):
            raise TypeError(
                f"MaskSpace(codec=...) needs encode(image, mask, box) and decode(codes, image), got {codec!r}"
            )
        if image is not None and codec is None:
            raise ValueError("MaskSpace(image=...) binds an image for the token mode: give codec= too")
        self.grid = grid
        self.codec = codec
        self.image = None if image is None else np.asarray(image.convert("RGB") if hasattr(image, "convert") else image)
        self._decoded: dict[tuple[int, int], np.ndarray] = {}

    @property
    def tokens(self) -> bool:
        """Whether regions are written as mask tokens (a codec is set)."""
        return self.codec is not None

    def for_image(self, image: Any) -> MaskSpace:
        """This token-mode space bound to ``image`` (uint8 ``[H, W, 3]`` or PIL), with an empty decode cache."""
        if self.codec is None:
            raise ValueError("MaskSpace.for_image: only the token mode (MaskSpace(codec=...)) reads images")
        bound = copy.copy(self)
        bound.image = np.asarray(image.convert("RGB") if hasattr(image, "convert") else image)
        bound._decoded = {}
        return bound

    def _need_image(self, what: str) -> np.ndarray:
        if self.image is None:
            # RuntimeError, not ValueError: parse() turns ValueErrors into "unreadable"; this is a wiring bug
            raise RuntimeError(f"MaskSpace(codec=...).{what} needs the sample's image: call space.for_image(image)")
        return self.image

    def normalize(self, region: Any) -> Any:
        if region is NO_TARGET:
            return region
        arr = np.asarray(region)
        if self.tokens:
            if arr.ndim != 2 or (self.image is not None and arr.shape != self.image.shape[:2]):
                want = "[H, W]" if self.image is None else f"{list(self.image.shape[:2])}"
                raise ValueError(
                    f"a mask region of a token-mode MaskSpace is a bool {want} pixel mask, got {arr.shape}"
                )
        elif arr.shape != (self.grid, self.grid):
            raise ValueError(
                f"a mask region of MaskSpace(grid={self.grid}) is a [{self.grid}, {self.grid}] array, got shape "
                f"{arr.shape}; rasterise pixel masks with MaskSpace.from_pixels"
            )
        arr = arr.astype(bool)
        if not arr.any():
            return NO_TARGET
        arr.setflags(write=False)
        return arr

    # --- token mode -----------------------------------------------------------------------------------------------

    def codes(self, text: Any) -> list[tuple[int, int]]:
        """The raw code pairs of every well-formed mask-token span of ``text`` (``[]`` in grid mode or for junk)."""
        if not self.tokens or not isinstance(text, str):
            return []
        return parse_masks(text[:20_000])

    def decode(self, codes: Sequence[int]) -> np.ndarray:
        """The bound image's pixel mask of one code pair (cached)."""
        key = (int(codes[0]), int(codes[1]))
        if key not in self._decoded:
            self.store(key, self.codec.decode(key, self._need_image("parse")))
        return self._decoded[key]

    def is_decoded(self, codes: Sequence[int]) -> bool:
        """Whether ``codes``' mask is in this bound space's decode cache."""
        return (int(codes[0]), int(codes[1])) in self._decoded

    def store(self, codes: Sequence[int], mask: Any) -> None:
        """Put a mask decoded elsewhere (a batched decode of a step's spans) into the decode cache."""
        if len(self._decoded) >= self.DECODE_CACHE:
            self._decoded.clear()
        mask = np.asarray(mask, dtype=bool)
        mask.setflags(write=False)
        self._decoded[(int(codes[0]), int(codes[1]))] = mask

    def serialize_objects(self, masks: Sequence[Any]) -> str:
        """One mask-token span per (non-empty) object mask, concatenated; ``no target`` when all are empty."""
        spans = [self.serialize(m) for m in masks]
        spans = [s for s in spans if s != "no target"]
        return "".join(spans) if spans else "no target"

    def _serialize(self, region: np.ndarray) -> str:
        if self.tokens:
            image = self._need_image("serialize")
            return format_mask(tuple(self.codec.encode(image, region, None)))
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
        if self.tokens:
            found = self.codes(text)
            if not found:
                return None
            out = np.zeros(self._need_image("parse").shape[:2], dtype=bool)
            for pair in found:
                out |= self.decode(pair)
            return out
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
        """Rasterise a pixel mask ``[H, W]`` to the grid (module docstring); an empty mask is ``NO_TARGET``. In
        token mode regions are pixel masks already: the mask itself."""
        if self.tokens:
            return self.normalize(mask)
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
        if self.tokens:
            if region.shape != (height, width):
                raise ValueError(f"a token-mode mask is {list(region.shape)} pixels, not [{height}, {width}]")
            return region
        rows = (np.arange(height) * 2 + 1) * self.grid // (2 * height)
        cols = (np.arange(width) * 2 + 1) * self.grid // (2 * width)
        return region[rows[:, None], cols[None, :]]

    def from_box(self, box: Any, height: int, width: int) -> Any:
        """The grid mask of a pixel box ``[x1, y1, x2, y2]`` on a ``height x width`` image (pixels x1 <= x < x2)."""
        x1, y1, x2, y2 = (int(round(float(v))) for v in box)
        mask = np.zeros((height, width), dtype=bool)
        mask[max(y1, 0) : max(y2, 0), max(x1, 0) : max(x2, 0)] = True
        return self.from_pixels(mask)

    def __getstate__(self) -> dict:  # DataLoader workers / checkpoints: no decode cache
        state = dict(self.__dict__)
        state["_decoded"] = {}
        return state
