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

Masks are decoded by ``core.regions.coco_masks`` (polygons and both RLE forms, without pycocotools).

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
from core.regions.coco_masks import segmentation_to_mask

__all__ = [
    "SegRecord",
    "load_seg_sample",
    "open_image",
    "read_gres",
    "read_groundingsuite",
]


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
