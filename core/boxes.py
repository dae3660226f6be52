"""Boxes written in text, and their geometry: the parsing and the maths that the rewards, the evolved questions'
process reward and the benchmarks share (``core/rewards.py`` re-exports the public names for its callers).

Box conventions: a box is ``[x1, y1, x2, y2]`` in absolute pixels. Qwen2.5-VL answers in pixels of the *resized*
model input; ground truth is in original pixels, so answers are rescaled by ``(orig_w / input_w, orig_h / input_h)``
(``rescale_box``) before comparison (as VLM-R1 does). Numbers are taken as written: no guessing of normalised [0, 1]
or Qwen2-VL 0-1000 coordinates, and parenthesised tuples ``(x1, y1, x2, y2)`` are not boxes (they are ambiguous with
Qwen2-VL's corner pairs and with x, y, w, h).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from typing import Any

__all__ = ["Box", "extract_boxes", "iou", "rescale_box"]

Box = list[float]

# ---------------------------------------------------------------------------------------------------------------------
# Parsing
# ---------------------------------------------------------------------------------------------------------------------

_NUM = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"


def _atomic(group: int) -> str:
    """``_NUM`` matched without backtracking, as capture group ``group`` (a lookahead captures, a backreference
    consumes: Python 3.10's stand-in for ``(?>...)``). Nothing that may follow a number here (space, comma, bracket,
    end of text) continues one, so a shorter number never matches where the longest fails and the matches are those of
    plain ``_NUM``; but a runaway digit string fails in one pass instead of giving digits back one at a time (10 MB of
    digits: ~40 ms instead of ~1 s)."""
    return rf"(?=({_NUM}))\{group}"


_NUMBER = re.compile(_atomic(1))
_BOX_RE = re.compile(rf"\[\s*{_atomic(1)}\s*,\s*{_atomic(2)}\s*,\s*{_atomic(3)}\s*,\s*{_atomic(4)}\s*\]")
_FENCE_RE = re.compile(r"```[ \t]*(?:json|JSON|Json)?")
_BOX_KEYS = ("bbox_2d", "bbox", "box_2d", "box", "bounding_box")
_MAX_DEPTH = 32


def _finite_box(values: Sequence[Any]) -> Box | None:
    """Four finite numbers (numbers or numeric strings, not bools) -> [x1, y1, x2, y2], else None."""
    if len(values) != 4:
        return None
    out = []
    for v in values:
        if isinstance(v, bool):
            return None
        if isinstance(v, (int, float)):
            try:
                x = float(v)
            except OverflowError:  # a JSON integer too large for a float
                return None
        elif isinstance(v, str) and _NUMBER.fullmatch(v.strip()):
            x = float(v.strip())
        else:
            return None
        if not math.isfinite(x):
            return None
        out.append(x)
    return out


def _regex_boxes(text: str) -> list[Box]:
    boxes = []
    for match in _BOX_RE.finditer(text):
        box = _finite_box([float(g) for g in match.groups()])
        if box is not None:
            boxes.append(box)
    return boxes


def _walk(obj: Any, out: list[Box], depth: int = 0) -> None:
    """Collect boxes from parsed JSON: {"bbox_2d": [...]} objects, bare 4-number lists, stringified lists."""
    if depth > _MAX_DEPTH:
        return
    if isinstance(obj, dict):
        for key in _BOX_KEYS:
            if key in obj:
                value = obj[key]
                if isinstance(value, str):  # a stringified list: "[1, 2, 3, 4]"
                    out.extend(_regex_boxes(value)[:1])
                elif isinstance(value, list) and (box := _finite_box(value)) is not None:
                    out.append(box)
                return  # the object's box key decides; a point or an empty list is not a box
        for value in obj.values():
            _walk(value, out, depth + 1)
    elif isinstance(obj, list):
        box = _finite_box(obj)
        if box is not None:
            out.append(box)
            return
        for value in obj:
            _walk(value, out, depth + 1)
    elif isinstance(obj, str):
        out.extend(_regex_boxes(obj))


def extract_boxes(text: str) -> list[Box]:
    """All boxes written in ``text``, in order; never raises.

    Reads a plain list ``[x1, y1, x2, y2]`` (ints or floats), VLM-R1 / Qwen2.5-VL JSON (``{"bbox_2d": [...]}``, a list
    of them, also under ``bbox`` / ``box`` / ``bounding_box``), with or without ```json fences (duplicated, stray, tab
    indented). When the text is not valid JSON (trailing prose, concatenated objects, stray quotes, truncation), boxes
    are salvaged as every "4 numbers inside square brackets". Non-finite numbers and 2-number points are not boxes.
    """
    if not isinstance(text, str) or not text:
        return []
    stripped = _FENCE_RE.sub("\n", text).strip()
    try:
        parsed = json.loads(stripped)
    except (ValueError, RecursionError):
        return _regex_boxes(stripped)
    out: list[Box] = []
    _walk(parsed, out)
    return out


# ---------------------------------------------------------------------------------------------------------------------
# Geometry
# ---------------------------------------------------------------------------------------------------------------------


def _valid_box(box: Any) -> tuple[float, float, float, float] | None:
    try:
        if len(box) != 4:
            return None
        x1, y1, x2, y2 = (float(v) for v in box)
    except (TypeError, ValueError, OverflowError):
        return None
    if not all(math.isfinite(v) for v in (x1, y1, x2, y2)) or x2 <= x1 or y2 <= y1:
        return None
    return x1, y1, x2, y2


def iou(a: Sequence[float], b: Sequence[float]) -> float:
    """Continuous intersection over union of two [x1, y1, x2, y2] boxes (no +1 pixel convention).

    0.0 when either box is malformed, empty (zero area), reversed (x2 < x1 or y2 < y1) or not finite.
    """
    ba, bb = _valid_box(a), _valid_box(b)
    if ba is None or bb is None:
        return 0.0
    iw = min(ba[2], bb[2]) - max(ba[0], bb[0])
    ih = min(ba[3], bb[3]) - max(ba[1], bb[1])
    if iw <= 0 or ih <= 0:
        return 0.0
    inter = iw * ih
    union = (ba[2] - ba[0]) * (ba[3] - ba[1]) + (bb[2] - bb[0]) * (bb[3] - bb[1]) - inter
    if not (union > 0 and math.isfinite(union)):
        return 0.0
    return float(min(max(inter / union, 0.0), 1.0))


def rescale_box(box: Sequence[float], input_wh: Sequence[float], orig_wh: Sequence[float]) -> Box:
    """Map a box from the resized model input (``input_wh`` = (w, h)) to original pixels (``orig_wh``).

    Qwen2.5-VL answers in absolute pixels of the image it was fed (resized to multiples of 28); x is multiplied by
    orig_w / input_w and y by orig_h / input_h.
    """
    iw, ih = float(input_wh[0]), float(input_wh[1])
    ow, oh = float(orig_wh[0]), float(orig_wh[1])
    if not (iw > 0 and ih > 0 and ow > 0 and oh > 0):
        raise ValueError(f"image sizes must be positive (w, h); got input_wh={input_wh}, orig_wh={orig_wh}")
    sx, sy = ow / iw, oh / ih
    x1, y1, x2, y2 = (float(v) for v in box)
    return [x1 * sx, y1 * sy, x2 * sx, y2 * sy]
