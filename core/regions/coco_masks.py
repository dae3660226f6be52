"""COCO masks without pycocotools (a test-only dependency here): decoded for the referring-segmentation readers
(``datamodules/gres.py``) and the offline benchmarks (``evals/``), encoded for the predictions they write.

COCO segmentations come in three forms, all read:
polygons (a list of ``[x1, y1, x2, y2, ...]`` rings: a pixel is in when its centre ``(x + 0.5, y + 0.5)`` lies inside
an odd number of rings' edges, the even-odd rule; rings of fewer than 3 points are dropped, as the released
evaluation drops them), uncompressed RLE (``{"counts": [ints], "size": [h, w]}``) and compressed RLE (``counts`` a
string in COCO's 6-bit format: each count a little-endian run of 5-bit groups, ``0x20`` = more groups follow, the
last group's ``0x10`` the sign, counts after the second stored as the difference to the count two before). Runs
alternate background / foreground, column-major (Fortran order). `rle_encode` writes the compressed form, so a
prediction this project writes opens in pycocotools and in the released scorers. Checked against pycocotools in
tests/datamodules/test_cycle_data.py: RLE is bit-exact both ways; polygons differ from COCO's rasteriser on outline
pixels only (COCO rasterises an upsampled outline, we test pixel centres): mean IoU >= 0.97 on small octagons.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["polygons_to_mask", "rle_decode", "rle_encode", "segmentation_to_mask"]


def _counts_from_string(s: str) -> list[int]:
    """COCO's compressed RLE string -> run lengths (module docstring)."""
    counts: list[int] = []
    p = 0
    while p < len(s):
        x, k, more = 0, 0, True
        while more:
            if p >= len(s):
                raise ValueError("truncated compressed RLE string (a count's last 5-bit group is missing)")
            c = ord(s[p]) - 48
            if not 0 <= c < 64:
                raise ValueError(f"character {s[p]!r} at {p} is not in COCO's RLE alphabet (chr(48)..chr(111))")
            x |= (c & 0x1F) << (5 * k)
            more = bool(c & 0x20)
            p += 1
            k += 1
            if not more and c & 0x10:
                x |= -1 << (5 * k)
        if len(counts) > 2:
            x += counts[-2]
        counts.append(x)
    return counts


def _counts_to_string(counts: list[int]) -> str:
    out = []
    for i, x in enumerate(counts):
        if i > 2:
            x -= counts[i - 2]
        more = True
        while more:
            c = x & 0x1F
            x >>= 5
            more = x != -1 if c & 0x10 else x != 0
            if more:
                c |= 0x20
            out.append(chr(c + 48))
    return "".join(out)


def rle_decode(rle: dict[str, Any]) -> np.ndarray:
    """bool ``[h, w]`` of a COCO RLE ``{"size": [h, w], "counts": str | bytes | [ints]}``; ValueError when malformed."""
    if not isinstance(rle, dict) or "counts" not in rle or "size" not in rle:
        raise ValueError(f"an RLE mask is {{'size': [h, w], 'counts': ...}}, got {str(rle)[:80]!r}")
    h, w = (int(v) for v in rle["size"])
    counts = rle["counts"]
    if isinstance(counts, bytes):
        counts = counts.decode("ascii")
    counts = _counts_from_string(counts) if isinstance(counts, str) else [int(c) for c in counts]
    if any(c < 0 for c in counts) or sum(counts) != h * w:
        raise ValueError(f"RLE counts sum to {sum(counts)} (or hold a negative run) for a {h}x{w} mask ({h * w})")
    values = np.zeros(len(counts), dtype=bool)
    values[1::2] = True  # runs alternate background / foreground, starting with background
    flat = np.repeat(values, counts)
    return flat.reshape(w, h).T.copy()  # column-major


def rle_encode(mask: np.ndarray) -> dict[str, Any]:
    """COCO compressed RLE ``{"size": [h, w], "counts": str}`` of a bool ``[h, w]`` mask (pycocotools reads it)."""
    mask = np.asarray(mask, dtype=bool)
    h, w = mask.shape
    flat = mask.T.reshape(-1)  # column-major
    counts: list[int] = []
    if flat.size:
        bounds = np.concatenate([[0], np.flatnonzero(flat[1:] != flat[:-1]) + 1, [flat.size]])
        counts = [int(c) for c in np.diff(bounds)]
        if flat[0]:  # the first run counts background: none
            counts = [0, *counts]
    return {"size": [h, w], "counts": _counts_to_string(counts)}


def polygons_to_mask(polygons: list[list[float]], height: int, width: int) -> np.ndarray:
    """bool ``[height, width]``: pixels whose centre lies inside the rings (even-odd); rings under 3 points dropped."""
    out = np.zeros((height, width), dtype=bool)
    for ring in polygons:
        if not isinstance(ring, list | tuple) or len(ring) < 6 or len(ring) % 2:
            continue
        pts = np.asarray(ring, dtype=np.float64).reshape(-1, 2)
        x0, y0 = max(int(np.floor(pts[:, 0].min())), 0), max(int(np.floor(pts[:, 1].min())), 0)
        x1, y1 = min(int(np.ceil(pts[:, 0].max())) + 1, width), min(int(np.ceil(pts[:, 1].max())) + 1, height)
        if x0 >= x1 or y0 >= y1:
            continue
        ys, xs = np.mgrid[y0:y1, x0:x1].astype(np.float64) + 0.5
        inside = np.zeros(ys.shape, dtype=bool)
        for (ax, ay), (bx, by) in zip(pts, np.roll(pts, -1, axis=0)):
            crosses = (ay > ys) != (by > ys)
            dy = by - ay if by != ay else 1.0
            inside ^= crosses & (xs < ax + (bx - ax) * (ys - ay) / dy)
        out[y0:y1, x0:x1] |= inside  # the rings of one object are its parts: their union, as COCO merges them
    return out


def segmentation_to_mask(seg: Any, height: int, width: int) -> np.ndarray:
    """A COCO ``segmentation`` (polygons, uncompressed or compressed RLE) as bool ``[height, width]``."""
    if isinstance(seg, dict):
        mask = rle_decode(seg)
        if mask.shape != (height, width):
            raise ValueError(f"RLE size {list(mask.shape)} differs from the image's [{height}, {width}]")
        return mask
    if isinstance(seg, list) and all(isinstance(r, list | tuple) for r in seg):
        return polygons_to_mask(seg, height, width)
    raise ValueError(f"a segmentation is a list of polygons or an RLE dict, got {type(seg).__name__}")
