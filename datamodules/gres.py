"""Referring-segmentation benchmarks in their public layouts: GRES (gRefCOCO) and GroundingSuite-Eval, with exact masks.

Both give one record per expression (`SegRecord`): the image, the expression, the target's pixel mask (the union of
its objects, decoded on demand from the annotation) and boxes; GRES's no-target expressions have an empty mask.

- **GRES / gRefCOCO** (`read_gres`): ``grefs(unc).json`` is a list of refs ``{"ref_id", "image_id", "ann_id": [ids]
  or [-1], "split", "no_target", "sentences": [{"sent", "sent_id", ...}], "category_id"}``; ``instances.json`` is
  COCO's ``{"images": [{"id", "file_name", "height", "width"}], "annotations": [{"id", "image_id", "segmentation",
  "bbox": [x, y, w, h]}]}``. A ref with ``ann_id == [-1]`` (or ``no_target: true``) refers to nothing; a ref with
  several ids refers to all of them (the mask is their union, as the released evaluation merges them). Sentences are
  stripped and lower-cased, as the released evaluation (``evaluation/gres/qwen3vl_gres_eval.py``) reads them.
- **GroundingSuite-Eval** (`read_groundingsuite`): a JSONL of ``{"idx", "image_path", "caption", "label",
  "class_id", "box": [x1, y1, x2, y2], "segmentation": RLE}``, images under the folder of the file (``--image-root``
  otherwise), as the released ``groundingsuite_metric.py`` reads it.

**Masks without pycocotools** (it is a test-only dependency here). COCO segmentations come in three forms, all read:
polygons (a list of ``[x1, y1, x2, y2, ...]`` rings: a pixel is in when its centre ``(x + 0.5, y + 0.5)`` lies inside
an odd number of rings' edges, the even-odd rule; rings of fewer than 3 points are dropped, as the released
evaluation drops them), uncompressed RLE (``{"counts": [ints], "size": [h, w]}``) and compressed RLE (``counts`` a
string in COCO's 6-bit format: each count a little-endian run of 5-bit groups, ``0x20`` = more groups follow, the
last group's ``0x10`` the sign, counts after the second stored as the difference to the count two before). Runs
alternate background / foreground, column-major (Fortran order). `rle_encode` writes the compressed form, so a
prediction this project writes opens in pycocotools and in the released scorers. Checked against pycocotools in
tests/datamodules/test_cycle_data.py: RLE is bit-exact both ways; polygons differ from COCO's rasteriser on outline
pixels only (COCO rasterises an upsampled outline, we test pixel centres): mean IoU >= 0.97 on small octagons.

Every defect raises ``DataError`` naming the file and the ref / line and what to fix.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from core.records import DataError, Sample, jsonl_objects

__all__ = [
    "SegRecord",
    "load_seg_sample",
    "open_image",
    "polygons_to_mask",
    "read_gres",
    "read_groundingsuite",
    "rle_decode",
    "rle_encode",
    "segmentation_to_mask",
]


# --- COCO masks ------------------------------------------------------------------------------------------------------


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


# --- records ---------------------------------------------------------------------------------------------------------


@dataclass
class SegRecord:
    """One referring expression of a segmentation benchmark (image not opened yet).

    ``boxes`` are the target objects' ``[x1, y1, x2, y2]`` (original pixels; empty for no target); ``mask()`` decodes
    the union of their segmentations (bool ``[h, w]``, all False for no target)."""

    sample_id: str
    image_path: Path
    query: str
    height: int
    width: int
    boxes: list[list[float]]
    segmentations: list[Any]
    source: str
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def no_target(self) -> bool:
        return not self.segmentations

    def mask(self) -> np.ndarray:
        out = np.zeros((self.height, self.width), dtype=bool)
        for seg in self.segmentations:
            try:
                out |= segmentation_to_mask(seg, self.height, self.width)
            except ValueError as err:
                raise DataError(f"{self.source}: bad segmentation ({err})") from None
        return out


def open_image(path: str | Path, source: str, size: tuple[int, int] | None = None) -> Image.Image:
    """The RGB image at ``path``; ``DataError`` naming ``source`` (the record's file and row) when it is missing,
    unreadable, or not ``size`` (``(width, height)``) when given. Every benchmark reader opens its images so."""
    try:
        with Image.open(path) as im:
            image = im.convert("RGB")
    except FileNotFoundError:
        raise DataError(
            f"{source}: image {path} not found; set --image-root to the folder that holds the images"
        ) from None
    except OSError as err:
        raise DataError(f"{source}: image {path} cannot be read ({err})") from None
    if size is not None and image.size != tuple(size):
        raise DataError(
            f"{source}: image {path} is {image.size[0]}x{image.size[1]}, the annotation says {size[0]}x{size[1]}: "
            "wrong image folder or annotation file"
        )
    return image


def load_seg_sample(rec: SegRecord) -> Sample:
    """The record as the project's `Sample` (what `greedy_answers` reads): the image opened, one box (the union of
    the targets' boxes; none for no target), ``meta`` with ``no_target``, the per-object boxes and the record's
    ``meta``. Raises ``DataError`` for a missing or unreadable image, or one whose size is not the annotation's."""
    image = open_image(rec.image_path, rec.source, (rec.width, rec.height))
    box = []
    if rec.boxes:
        b = np.asarray(rec.boxes, dtype=np.float64)
        box = [[float(b[:, 0].min()), float(b[:, 1].min()), float(b[:, 2].max()), float(b[:, 3].max())]]
    meta = {**rec.meta, "no_target": rec.no_target, "target_boxes": [list(b) for b in rec.boxes]}
    return Sample(rec.sample_id, image, rec.query, box, "rec", str(rec.image_path), rec.source, meta)


def _load_json(path: Path, what: str) -> Any:
    if not path.is_file():
        raise DataError(f"{path}: no such {what} file")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise DataError(f"{path}: not valid JSON ({err})") from None


def _xywh_to_xyxy(bbox: Any, where: str) -> list[float]:
    if not (isinstance(bbox, list | tuple) and len(bbox) == 4 and all(isinstance(v, int | float) for v in bbox)):
        raise DataError(f"{where}: 'bbox' must be [x, y, w, h], got {bbox!r}")
    x, y, w, h = (float(v) for v in bbox)
    return [x, y, x + w, y + h]


def read_gres(
    grefs: str | Path,
    instances: str | Path,
    image_root: str | Path,
    split: str = "val",
    *,
    max_samples: int | None = None,
) -> list[SegRecord]:
    """One `SegRecord` per sentence of the refs of ``split`` (``val``, ``testA``, ``testB``, ``train``) in file order."""
    grefs, instances, root = Path(grefs), Path(instances), Path(image_root)
    refs = _load_json(grefs, "gRefCOCO refs (grefs(unc).json)")
    inst = _load_json(instances, "COCO instances (instances.json)")
    if not isinstance(refs, list):
        raise DataError(f"{grefs}: expected a list of refs (gRefCOCO's grefs(unc).json)")
    if not isinstance(inst, dict) or not {"images", "annotations"} <= set(inst):
        raise DataError(f"{instances}: expected COCO instances with 'images' and 'annotations'")
    images = {im["id"]: im for im in inst["images"]}
    anns = {a["id"]: a for a in inst["annotations"]}
    splits = {r.get("split") for r in refs if isinstance(r, dict)}
    if split not in splits:
        raise DataError(f"{grefs}: no ref of split {split!r}; the file has splits {sorted(map(str, splits))}")
    out: list[SegRecord] = []
    for i, ref in enumerate(refs):
        where = f"{grefs} ref #{i}"
        if not isinstance(ref, dict) or ref.get("split") != split:
            continue
        for key in ("ref_id", "image_id", "ann_id", "sentences"):
            if key not in ref:
                raise DataError(f"{where}: missing {key!r}")
        where = f"{grefs} ref_id {ref['ref_id']}"
        img = images.get(ref["image_id"])
        if img is None:
            raise DataError(f"{where}: image_id {ref['image_id']} is not in {instances}")
        ann_ids = ref["ann_id"] if isinstance(ref["ann_id"], list) else [ref["ann_id"]]
        no_target = bool(ref.get("no_target")) or ann_ids == [-1] or not ann_ids
        if no_target and any(a != -1 for a in ann_ids):
            raise DataError(f"{where}: marked no_target but refers to annotations {ann_ids}")
        segs, boxes = [], []
        for a in [] if no_target else ann_ids:
            ann = anns.get(a)
            if ann is None:
                raise DataError(f"{where}: ann_id {a} is not in {instances}")
            seg = ann.get("segmentation")
            if isinstance(seg, list) and not any(isinstance(r, list) and len(r) >= 6 for r in seg):
                raise DataError(f"{where}: annotation {a} has no polygon of 3 or more points")
            segs.append(seg)
            boxes.append(_xywh_to_xyxy(ann.get("bbox"), f"{instances} annotation {a}"))
        for j, sent in enumerate(ref["sentences"]):
            text = sent.get("sent") if isinstance(sent, dict) else None
            if not isinstance(text, str) or not text.strip():
                raise DataError(f"{where}: sentence #{j} has no 'sent' text")
            out.append(
                SegRecord(
                    sample_id=f"gres-{split}-{ref['ref_id']}-{sent.get('sent_id', j)}",
                    image_path=root / img["file_name"],
                    query=text.strip().lower(),
                    height=int(img["height"]),
                    width=int(img["width"]),
                    boxes=boxes,
                    segmentations=segs,
                    source=f"{where} sentence #{j}",
                    meta={"ref_id": ref["ref_id"], "split": split, "n_targets": len(segs)},
                )
            )
            if max_samples is not None and len(out) >= max_samples:
                return out
    return out


def read_groundingsuite(
    path: str | Path, image_root: str | Path | None = None, *, max_samples: int | None = None
) -> list[SegRecord]:
    """One `SegRecord` per line of GroundingSuite-Eval's JSONL (``meta``: ``idx``, ``class_id``, ``label``)."""
    path = Path(path)
    root = Path(image_root) if image_root is not None else path.parent
    if not path.is_file():
        raise DataError(f"{path}: no such GroundingSuite file (GroundingSuite-Eval.jsonl)")
    out: list[SegRecord] = []
    for obj, where in jsonl_objects(path):
        missing = [k for k in ("idx", "image_path", "caption", "class_id", "segmentation") if k not in obj]
        if missing:
            raise DataError(
                f"{where}: missing {missing} (GroundingSuite-Eval lines have idx, image_path, caption, "
                "label, class_id, box, segmentation)"
            )
        seg = obj["segmentation"]
        if not isinstance(seg, dict) or "size" not in seg:
            raise DataError(f"{where}: 'segmentation' must be an RLE dict with 'size' and 'counts'")
        h, w = (int(v) for v in seg["size"])
        box = obj.get("box")
        boxes = [[float(v) for v in (box[0] if box and isinstance(box[0], list) else box)]] if box else []
        out.append(
            SegRecord(
                sample_id=f"gsuite-{obj['idx']}",
                image_path=root / obj["image_path"],
                query=str(obj["caption"]).strip(),
                height=h,
                width=w,
                boxes=boxes,
                segmentations=[seg],
                source=where,
                meta={"idx": obj["idx"], "class_id": obj["class_id"], "label": obj.get("label", "")},
            )
        )
        if max_samples is not None and len(out) >= max_samples:
            break
    if not out:
        raise DataError(f"{path}: no samples in the file")
    return out
