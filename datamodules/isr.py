"""ISR perception data: rendered 3D-FRONT views -> the OVD JSONL that ``datamodules.rec`` reads (docs/isr.md).

The paper splits ISR into a perception stage, trained with OVD's reward (``s_ovd * mAP``) and where Syn-GRPO applies,
and a refinement stage (out of scope here). The perception stage is OVD on rendered indoor views, so this module is
only a converter: the project's OVD path (task ``ovd``, ``SyntheticDataModule``) trains on what it writes, and the
seeded 2,000-sample draw is the data module's (``max_train_samples``), not the converter's.

The accepted render layout (one folder, searched recursively; the project does not render 3D-FRONT itself)::

    <render_root>/<anything>/<view>.json      one JSON per rendered view, beside its image
    <render_root>/<anything>/<view>.png       (or .jpg / .jpeg; or the file the JSON's "image" names)

    {"image": "0003.png",                     optional: the image, relative to the JSON's folder
     "width": 640, "height": 480,             optional: checked against the image
     "scene": "<3D-FRONT scene uid>", "room": "<room id>", "view": 3, "camera": {...},   optional, kept in meta
     "objects": [                             required: the visible objects, one entry per instance
        {"category": "chair", "bbox": [x1, y1, x2, y2],   required: a name, and a box in pixels of the image
         "instance": 12, "model_id": "<3D-FUTURE jid>", "visible_fraction": 0.8}]}   optional, kept in meta

``bbox`` is ``[x1, y1, x2, y2]`` in pixels of the rendered image (the reader's and the reward's frame): BlenderProc's
``bproc.writer.write_coco_annotations`` writes COCO's ``[x, y, w, h]``, so convert (x2 = x + w) when exporting.

One JSONL line per (view, category) by default (``--group category``): the question names one category and the
solution holds every box of it in the view, as D3's OVD samples do, so the class-agnostic OVD reward checks exactly
what was asked. ``--group view`` writes one line per view whose question lists every category in it (the reward then
does not check which box is which category). A line is laid out as the D3 converter's: the human turn is VLM-R1's OVD
question (``datamodules.d3.ovd_row_question``: "Please carefully check the image and detect the following objects:
['dining chair']." and VLM-R1's answer format), so ``core.prompts.question_text`` asks it as VLM-R1 does; the gpt turn
is VLM-R1's labelled JSON answer (each box with its category); the reader takes the boxes from ``solution``.

CLI::

    python -m datamodules.isr RENDER_ROOT OUT.jsonl [--image-root DIR] [--group category|view] [--min-side 4]

Every defect (a missing image, a box outside the image, an unknown field, ...) raises ``DataError`` naming the JSON
file and what to fix.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from PIL import Image

from core.records import DataError
from datamodules.d3 import ovd_row_question

VIEW_FIELDS = ("image", "width", "height", "scene", "room", "view", "camera", "objects")
"""The keys a view JSON may have (anything else is an error: a typo must not silently drop data)."""
OBJECT_FIELDS = ("category", "bbox", "instance", "model_id", "visible_fraction")
"""The keys an object entry may have."""
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
GROUPS = ("category", "view")


@dataclass(frozen=True)
class ViewObject:
    """One labelled instance of a view: ``box`` is ``[x1, y1, x2, y2]`` in image pixels."""

    category: str
    box: tuple[float, float, float, float]


@dataclass
class View:
    """A parsed render: its JSON, its image (relative to the image root), size, objects and free metadata."""

    json_path: Path
    image_rel: str
    width: int
    height: int
    objects: list[ViewObject]
    meta: dict[str, Any]


def normalise_category(name: str) -> str:
    """3D-FRONT / 3D-FUTURE names as a query: lower case, ``_`` and runs of spaces as one space
    (``"Dining_Chair"`` -> ``"dining chair"``; ``"Pendant Lamp"`` -> ``"pendant lamp"``)."""
    return re.sub(r"\s+", " ", name.replace("_", " ")).strip().lower()


def _image_for(json_path: Path, obj: dict) -> Path:
    if "image" in obj:
        if not isinstance(obj["image"], str) or not obj["image"]:
            raise DataError(f"{json_path}: 'image' must be a file name relative to the JSON's folder")
        path = json_path.parent / obj["image"]
        if not path.is_file():
            raise DataError(f"{json_path}: its image {path} does not exist; fix 'image' or render the view again")
        return path
    for suffix in IMAGE_SUFFIXES:
        path = json_path.with_suffix(suffix)
        if path.is_file():
            return path
    raise DataError(
        f"{json_path}: no image beside it ({json_path.stem}{{{','.join(IMAGE_SUFFIXES)}}}); "
        "save the rendered view under the JSON's name, or name it in the JSON's 'image' field"
    )


def _box(json_path: Path, i: int, raw: Any, w: int, h: int) -> tuple[float, float, float, float]:
    where = f"{json_path}: objects[{i}]"
    if not (isinstance(raw, list) and len(raw) == 4 and all(isinstance(v, int | float) for v in raw)):
        raise DataError(f"{where}: 'bbox' must be [x1, y1, x2, y2], 4 numbers in image pixels; got {raw!r}")
    x1, y1, x2, y2 = (float(v) for v in raw)
    if not all(math.isfinite(v) for v in (x1, y1, x2, y2)):
        raise DataError(f"{where}: 'bbox' {raw!r} has a non-finite coordinate")
    if x2 <= x1 or y2 <= y1:
        raise DataError(
            f"{where}: empty 'bbox' {raw!r}: need x2 > x1 and y2 > y1 ([x1, y1, x2, y2]; "
            "COCO's [x, y, w, h] must be converted: x2 = x + w, y2 = y + h)"
        )
    if x1 < 0 or y1 < 0 or x2 > w + 0.5 or y2 > h + 0.5:  # the reader's tolerance (datamodules.rec.load_sample)
        raise DataError(
            f"{where}: 'bbox' {raw!r} lies outside the {w}x{h} image; clip boxes to the visible part of the "
            "object when exporting (boxes from the instance segmentation map always fit)"
        )
    return x1, y1, x2, y2


def _check_fields(obj: dict, allowed, where: str, what: str) -> None:
    unknown = sorted(set(obj) - set(allowed))
    if unknown:
        raise DataError(
            f"{where} unknown field(s) {unknown}; {what} may hold {list(allowed)} "
            "(rename the field, or drop it from the export)"
        )


def read_view(json_path: str | Path, root: str | Path) -> View:
    """Parse and check one view JSON of the layout above; ``root`` is what the image path is made relative to."""
    json_path, root = Path(json_path), Path(root)
    try:
        obj = json.loads(json_path.read_text(encoding="utf-8"))
    except UnicodeDecodeError:
        raise DataError(f"{json_path}: not UTF-8; write the view JSON as UTF-8") from None
    except json.JSONDecodeError as err:
        raise DataError(f"{json_path}: not valid JSON ({err.msg} at line {err.lineno} column {err.colno})") from None
    if not isinstance(obj, dict):
        raise DataError(f"{json_path}: expected a JSON object with an 'objects' list")
    _check_fields(obj, VIEW_FIELDS, f"{json_path}:", "a view JSON")
    image_path = _image_for(json_path, obj)
    try:
        with Image.open(image_path) as im:
            w, h = im.size
    except OSError as err:
        raise DataError(f"{json_path}: its image {image_path} cannot be read ({err}); render the view again") from None
    for key, actual in (("width", w), ("height", h)):
        if key in obj and obj[key] != actual:
            raise DataError(
                f"{json_path}: '{key}' is {obj[key]!r} but the image {image_path.name} is {w}x{h}; "
                "the boxes were exported for another resolution: export them at the rendered size"
            )
    objects_raw = obj.get("objects")
    if not isinstance(objects_raw, list):
        raise DataError(f"{json_path}: missing 'objects' (a list of {{'category': ..., 'bbox': [x1, y1, x2, y2]}})")
    objects = []
    for i, o in enumerate(objects_raw):
        if not isinstance(o, dict):
            raise DataError(f"{json_path}: objects[{i}] must be an object with 'category' and 'bbox'")
        _check_fields(o, OBJECT_FIELDS, f"{json_path}: objects[{i}] has", "an object")
        cat = o.get("category")
        if not isinstance(cat, str) or not normalise_category(cat):
            raise DataError(f"{json_path}: objects[{i}] needs a 'category' name (e.g. \"chair\"); got {cat!r}")
        objects.append(ViewObject(normalise_category(cat), _box(json_path, i, o.get("bbox"), w, h)))
    meta = {k: obj[k] for k in ("scene", "room", "view", "camera") if k in obj}
    try:
        # absolute, unresolved: a relative render folder and an absolute --image-root (or the reverse) still match
        image_rel = Path(os.path.abspath(image_path)).relative_to(os.path.abspath(root)).as_posix()
    except ValueError:
        raise DataError(
            f"{json_path}: its image {image_path} lies outside the image root {root}; pass --image-root a folder that "
            "holds every split's images (it becomes the config's data.init_args.image_root)"
        ) from None
    return View(json_path, image_rel, w, h, objects, meta)


def iter_views(root: str | Path, image_root: str | Path | None = None) -> Iterator[View]:
    """Every view JSON under ``root`` (recursively, in sorted path order: the output is deterministic); image paths
    relative to ``image_root`` (default ``root``)."""
    root = Path(root)
    if not root.is_dir():
        raise DataError(f"{root}: no such render folder; pass the folder that holds the view JSONs and images")
    paths = sorted(root.rglob("*.json"))
    if not paths:
        raise DataError(f"{root}: no view JSON found (expected <view>.json beside <view>.png; see docs/isr.md)")
    for p in paths:
        yield read_view(p, root if image_root is None else image_root)


def _line(view: View, key: str, labelled: list[tuple[str, tuple[float, ...]]], categories: list[str]) -> dict:
    """The line asking ``view`` for ``categories``; ``labelled``: every (category, box) of the answer."""
    answer = [{"bbox_2d": [round(v, 2) for v in b], "label": c} for c, b in labelled]
    answer.sort(key=lambda a: (a["bbox_2d"][1], a["bbox_2d"][0]))
    stem = Path(view.image_rel).with_suffix("").as_posix().replace("/", "-")
    return {
        "id": f"isr-{stem}" + (f"-{key.replace(' ', '_')}" if key else ""),
        "image": view.image_rel,
        "conversations": [
            {"from": "human", "value": "<image>" + ovd_row_question(categories)},
            {"from": "gpt", "value": f"```json\n{json.dumps(answer)}\n```"},
        ],
        "solution": [a["bbox_2d"] for a in answer],
        "task": "ovd",
        "width": view.width,
        "height": view.height,
        "meta": {"source": "3d-front", "categories": categories, "n_objects": len(view.objects), **view.meta},
    }


def view_lines(view: View, group: str = "category", min_side: float = 0.0) -> list[dict]:
    """The OVD JSONL lines of one view (see the module docstring); objects with a side under ``min_side`` pixels are
    left out (slivers at the frame's edge or behind furniture), and a category left with no box gives no line."""
    if group not in GROUPS:
        raise DataError(f"--group must be one of {list(GROUPS)}; got {group!r}")
    kept = [o for o in view.objects if min(o.box[2] - o.box[0], o.box[3] - o.box[1]) >= min_side]
    by_cat: dict[str, list[tuple[float, ...]]] = {}
    for o in kept:
        by_cat.setdefault(o.category, []).append(o.box)
    if not by_cat:
        return []
    if group == "view":
        cats = sorted(by_cat)
        return [_line(view, "", [(c, b) for c in cats for b in by_cat[c]], cats)]
    return [_line(view, c, [(c, b) for b in boxes], [c]) for c, boxes in sorted(by_cat.items())]


def convert(
    root: str | Path,
    out: str | Path,
    group: str = "category",
    min_side: float = 4.0,
    image_root: str | Path | None = None,
) -> dict[str, int]:
    """Write the OVD JSONL of every view under ``root`` to ``out``; image paths are relative to ``image_root``
    (default ``root``; the config's ``data.init_args.image_root``: one for every split, so convert ``renders/train``
    and ``renders/val`` with ``image_root=renders``). Returns counts: ``views``, ``lines``, ``boxes``,
    ``dropped_small``, ``empty_views``."""
    out = Path(out)
    counts = {"views": 0, "lines": 0, "boxes": 0, "dropped_small": 0, "empty_views": 0}
    lines = []
    for view in iter_views(root, image_root):  # everything is checked before anything is written
        vl = view_lines(view, group, min_side)
        counts["views"] += 1
        counts["empty_views"] += not vl
        counts["lines"] += len(vl)
        n = sum(len(x["solution"]) for x in vl)
        counts["boxes"] += n
        counts["dropped_small"] += len(view.objects) - n
        lines += vl
    if not lines:
        raise DataError(f"{root}: no view has an object box of at least {min_side} px a side; nothing to write")
    ids = [x["id"] for x in lines]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise DataError(f"{root}: two views give the sample id {dup!r}; give each view image a distinct path")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text("".join(json.dumps(x) + "\n" for x in lines), encoding="utf-8")
    tmp.replace(out)
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m datamodules.isr",
        description="Rendered 3D-FRONT views (one <view>.json + image each; docs/isr.md) -> OVD JSONL for ISR's "
        "perception stage (configs/isr_3b.yaml). Image paths are written relative to --image-root (default "
        "RENDER_ROOT): set the config's data.init_args.image_root to it.",
    )
    ap.add_argument("render_root", help="folder holding the view JSONs and their images (searched recursively)")
    ap.add_argument("out", help="the JSONL to write, e.g. /data/isr/isr_train.jsonl")
    ap.add_argument(
        "--group", choices=GROUPS, default="category", help="one line per (view, category) (default) or per view"
    )
    ap.add_argument(
        "--min-side", type=float, default=4.0, help="leave out boxes with a side under this many pixels (default 4)"
    )
    ap.add_argument(
        "--image-root",
        default=None,
        help="write image paths relative to this folder (default RENDER_ROOT): the config's one image_root for "
        "every split, e.g. RENDER_ROOT=renders/train with --image-root renders",
    )
    args = ap.parse_args(argv)
    try:
        counts = convert(args.render_root, args.out, args.group, args.min_side, args.image_root)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(
        f"{args.out}: {counts['lines']} samples, {counts['boxes']} boxes from {counts['views']} views "
        f"({counts['dropped_small']} boxes under {args.min_side} px left out, {counts['empty_views']} views gave none)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
