"""D3 (Described Object Detection, ``shikras/d-cube``) -> the OVD JSONL that ``datamodules.rec`` reads (docs/d3.md).

D3 ships three archives: ``d3_images.zip`` (the images, ``<group>/<name>.jpg``), ``d3_pkl.zip`` (four pickled dicts,
the toolkit's input: ``d_cube.D3(IMG_ROOT, PKL_ANNO_PATH)``) and ``d3_json.zip`` (COCO-style JSON for evaluation).
The converter reads the pickles, as the toolkit does (``d_cube/d3.py``, ``D3.load_data``; fields in its ``doc.md``)::

    images.pkl       {img_id: {"id", "file_name", "height", "width", "anno_id": [...], "group_id", ...}}
    annotations.pkl  {anno_id: {"id", "image_id", "group_id", "sent_id": [...], "bbox": [[x, y, w, h]], ...}}
    sentences.pkl    {sent_id: {"id", "raw_sent", "is_negative", "anno_id": [...], "group_id": [...], ...}}
    groups.pkl       {group_id: {"id", "group_name", "inner_sent_id": [...], "img_id": [...], ...}}

``bbox`` is a 1 x 4 array ``[[x, y, w, h]]`` in pixels (the toolkit reads ``anno["bbox"][0]``); the converter writes
``[x1, y1, x2, y2]``. The pickles are read with an unpickler that builds only dicts, lists, numbers, strings, bytes and
numpy arrays: anything else is refused (a pickle can run code).

One JSONL line per (image, description) pair with at least one box, under D3's intra-group protocol (its evaluation
JSON, ``D3.convert2coco(is_group_separated=True)``): an image is asked its group's descriptions (``inner_sent_id``),
and the solution holds every box annotated with the description. Pairs without a box (D3's negatives) are not written:
the OVD reader and reward need at least one box. Each line carries its question as VLM-R1's OVD rows do
(``ovd_row_question``), so ``core.prompts.question_text`` asks it as VLM-R1 does.

D3 has no train / val / test split (it is an evaluation benchmark). The converter splits the images of each group at
random with ``--seed`` (``--val``, ``--test``: fractions), so every split has every scene and no image is in two.

CLI::

    python -m datamodules.d3 D3_IMAGES D3_PKL OUT_DIR [--val 0.1] [--test 0.1] [--seed 0] [--trust-pickles]

writes ``OUT_DIR/d3_{train,val,test}.jsonl`` (``configs/ovd_3b.yaml``'s names); image paths are relative to
``D3_IMAGES`` (the config's ``data.init_args.image_root``). Every defect raises ``DataError`` naming the file and
what to do; nothing is written from a release with a defect.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import pickle
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from core.prompts import OVD_ROW_FORMAT, OVD_ROW_LEAD
from core.records import DataError

PKL_FILES = ("images.pkl", "annotations.pkl", "sentences.pkl", "groups.pkl")
"""The four pickles of ``d3_pkl.zip`` (``D3.load_data``)."""
SPLITS = ("train", "val", "test")

_NUMPY = ("numpy", "numpy.core.multiarray", "numpy._core.multiarray", "numpy.core.numeric", "numpy._core.numeric")
_ALLOWED = {(m, n) for m in _NUMPY for n in ("_reconstruct", "scalar", "ndarray", "dtype", "_frombuffer")}
_ALLOWED |= {("_codecs", "encode"), ("builtins", "bytes"), ("collections", "OrderedDict")}


def ovd_row_question(descriptions: Sequence[str]) -> str:
    """The question of a VLM-R1 OVD row asking for ``descriptions`` (``['a dog not held by a leash']``): the human
    turn of every OVD line a converter writes (this one's, ``datamodules.isr``'s)."""
    return f"{OVD_ROW_LEAD}{list(descriptions)!s}.{OVD_ROW_FORMAT}"


class _ReleaseUnpickler(pickle.Unpickler):
    def __init__(self, fh, path: Path):
        super().__init__(fh)
        self.path = path

    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise DataError(
                f"{self.path}: holds a pickled {module}.{name}, which D3's annotation pickles do not; use the files "
                "of the official d3_pkl.zip (or, for a copy you trust, --trust-pickles)"
            )
        return super().find_class(module, name)


def _load_pkl(path: Path, trust: bool = False) -> dict:
    if not path.is_file():
        raise DataError(
            f"{path}: missing; D3_PKL must be the folder d3_pkl.zip extracts to (it holds {', '.join(PKL_FILES)})"
        )
    try:
        fh = io.BytesIO(path.read_bytes())
        obj = pickle.Unpickler(fh).load() if trust else _ReleaseUnpickler(fh, path).load()
    except DataError:
        raise
    except Exception as err:  # a truncated or foreign file: pickle raises many kinds
        raise DataError(
            f"{path}: not a readable pickle ({type(err).__name__}: {err}); extract d3_pkl.zip again"
        ) from None
    if not isinstance(obj, dict) or not all(isinstance(v, dict) for v in obj.values()):
        raise DataError(
            f"{path}: expected a dict of id -> record (D3's layout, doc.md 'Key Concepts'); got {type(obj).__name__}"
        )
    return obj


def _field(rec: dict, key: str, path: Path, rid: Any) -> Any:
    if key not in rec:
        raise DataError(
            f"{path}: record {rid!r} has no {key!r} (D3's layout, doc.md 'Key Concepts'); use the official d3_pkl.zip"
        )
    return rec[key]


def _ids(value: Any) -> list:
    return [int(v) for v in (value.tolist() if hasattr(value, "tolist") else value)]


def _xyxy(raw: Any, path: Path, aid: Any) -> list[float]:
    vals = raw.tolist() if hasattr(raw, "tolist") else raw
    if isinstance(vals, list) and len(vals) == 1 and isinstance(vals[0], list | tuple):
        vals = vals[0]  # [[x, y, w, h]]: the release's 1 x 4 array
    if not (isinstance(vals, list | tuple) and len(vals) == 4 and all(isinstance(v, int | float) for v in vals)):
        raise DataError(f"{path}: annotation {aid!r} has 'bbox' {raw!r}; expected [[x, y, w, h]] (4 numbers, pixels)")
    x, y, w, h = (float(v) for v in vals)
    if not all(math.isfinite(v) for v in (x, y, w, h)):
        raise DataError(f"{path}: annotation {aid!r} has a non-finite 'bbox' {vals!r}")
    return [x, y, x + w, y + h]


def read_release(
    pkl_dir: str | Path, image_root: str | Path, trust_pickles: bool = False
) -> tuple[list[dict], dict[str, int]]:
    """Every (image, description) line of the release (all splits, in image id order) and counts: ``images``,
    ``lines``, ``boxes``, ``negatives`` (pairs without a box), ``clipped`` / ``dropped`` (boxes cut to the image /
    empty once cut)."""
    pkl_dir, image_root = Path(pkl_dir), Path(image_root)
    if not pkl_dir.is_dir():
        raise DataError(f"{pkl_dir}: no such folder; pass the folder d3_pkl.zip extracts to as D3_PKL")
    if not image_root.is_dir():
        raise DataError(f"{image_root}: no such folder; pass the folder d3_images.zip extracts to as D3_IMAGES")
    images, annos, sents, groups = (_load_pkl(pkl_dir / name, trust_pickles) for name in PKL_FILES)
    ipath, apath, spath, gpath = (pkl_dir / name for name in PKL_FILES)
    counts = {"images": 0, "lines": 0, "boxes": 0, "negatives": 0, "clipped": 0, "dropped": 0}
    lines = []
    for img_id in sorted(images):
        img = images[img_id]
        name = _field(img, "file_name", ipath, img_id)
        w, h = int(_field(img, "width", ipath, img_id)), int(_field(img, "height", ipath, img_id))
        if not (image_root / name).is_file():
            raise DataError(
                f"{image_root / name}: missing (image {img_id!r} of {ipath}); pass as D3_IMAGES the folder "
                "d3_images.zip extracts to"
            )
        gid = _field(img, "group_id", ipath, img_id)
        if gid not in groups:
            raise DataError(
                f"{ipath}: image {img_id!r} names group {gid!r}, which {gpath} lacks; use one release's files"
            )
        group = groups[gid]
        by_sent: dict[int, list[list[float]]] = {}
        for aid in _ids(_field(img, "anno_id", ipath, img_id)):
            if aid not in annos:
                raise DataError(
                    f"{ipath}: image {img_id!r} names annotation {aid!r}, which {apath} lacks; use one release's files"
                )
            box = _xyxy(_field(annos[aid], "bbox", apath, aid), apath, aid)
            cut = [max(0.0, box[0]), max(0.0, box[1]), min(float(w), box[2]), min(float(h), box[3])]
            if cut[2] <= cut[0] or cut[3] <= cut[1]:
                counts["dropped"] += 1
                continue
            counts["clipped"] += cut != box
            for sid in _ids(_field(annos[aid], "sent_id", apath, aid)):
                by_sent.setdefault(sid, []).append(cut)
        counts["images"] += 1
        for sid in _ids(_field(group, "inner_sent_id", gpath, gid)):
            if sid not in sents:
                raise DataError(
                    f"{gpath}: group {gid!r} names sentence {sid!r}, which {spath} lacks; use one release's files"
                )
            boxes = sorted(by_sent.get(sid, []), key=lambda b: (b[1], b[0]))
            if not boxes:
                counts["negatives"] += 1
                continue
            desc = str(_field(sents[sid], "raw_sent", spath, sid)).strip()
            answer = [{"bbox_2d": [int(v) if v.is_integer() else v for v in b], "label": desc} for b in boxes]
            lines.append(
                {
                    "id": f"d3-{img_id}-{sid}",
                    "image": str(name),
                    "conversations": [
                        {"from": "human", "value": "<image>" + ovd_row_question([desc])},
                        {"from": "gpt", "value": f"```json\n{json.dumps(answer)}\n```"},
                    ],
                    "solution": [b["bbox_2d"] for b in answer],
                    "task": "ovd",
                    "width": w,
                    "height": h,
                    "meta": {
                        "source": "d3",
                        "image_id": int(img_id),
                        "sent_id": int(sid),
                        "group": str(group.get("group_name", gid)),
                        "description": desc,
                        "absence": bool(sents[sid].get("is_negative", False)),
                    },
                }
            )
            counts["boxes"] += len(boxes)
    counts["lines"] = len(lines)
    if not lines:
        raise DataError(f"{pkl_dir}: no image has a box for one of its group's descriptions; nothing to write")
    return lines, counts


def split_images(lines: list[dict], val: float, test: float, seed: int) -> dict[str, list[dict]]:
    """Each group's images shuffled with ``seed`` and cut into train / val / test by fraction (rounded, at least one
    image in a non-zero split when the group has enough); an image's lines stay together."""
    if val < 0 or test < 0 or val + test >= 1:
        raise DataError(f"--val and --test must be >= 0 with val + test < 1; got {val} and {test}")
    by_group: dict[str, list[int]] = {}
    for x in lines:
        ids = by_group.setdefault(x["meta"]["group"], [])
        if x["meta"]["image_id"] not in ids:
            ids.append(x["meta"]["image_id"])
    where: dict[int, str] = {}
    for g in sorted(by_group):
        ids = sorted(by_group[g])
        random.Random(f"{seed}:{g}").shuffle(ids)
        n_val, n_test = (max(int(f > 0), round(f * len(ids))) if len(ids) > 2 else 0 for f in (val, test))
        for i, img_id in enumerate(ids):
            where[img_id] = "val" if i < n_val else "test" if i < n_val + n_test else "train"
    out: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for x in lines:
        out[where[x["meta"]["image_id"]]].append(x)
    return out


def convert(
    image_root: str | Path,
    pkl_dir: str | Path,
    out_dir: str | Path,
    val: float = 0.1,
    test: float = 0.1,
    seed: int = 0,
    trust_pickles: bool = False,
) -> dict[str, Any]:
    """Write ``out_dir/d3_{train,val,test}.jsonl``; returns the counts of ``read_release`` and lines per split.
    ``trust_pickles`` reads the pickles without the allow-list (any class they name is built: a copy you trust)."""
    lines, counts = read_release(pkl_dir, image_root, trust_pickles)
    splits = split_images(lines, val, test, seed)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for split, rows in splits.items():
        out = out_dir / f"d3_{split}.jsonl"
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text("".join(json.dumps(x) + "\n" for x in rows), encoding="utf-8")
        tmp.replace(out)
    return {**counts, "splits": {s: len(rows) for s, rows in splits.items()}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m datamodules.d3",
        description="D3's release (d3_images.zip and d3_pkl.zip, extracted; docs/d3.md) -> OUT_DIR/d3_{train,val,test}"
        ".jsonl for configs/ovd_3b.yaml (data_root: OUT_DIR, image_root: D3_IMAGES).",
    )
    ap.add_argument("images", metavar="D3_IMAGES", help="the folder d3_images.zip extracts to")
    ap.add_argument(
        "pkl", metavar="D3_PKL", help="the folder d3_pkl.zip extracts to (images.pkl, annotations.pkl, ...)"
    )
    ap.add_argument("out", metavar="OUT_DIR", help="where d3_train.jsonl, d3_val.jsonl and d3_test.jsonl go")
    ap.add_argument("--val", type=float, default=0.1, help="fraction of each group's images for val (default 0.1)")
    ap.add_argument("--test", type=float, default=0.1, help="fraction of each group's images for test (default 0.1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the image split (default 0)")
    ap.add_argument(
        "--trust-pickles",
        action="store_true",
        help="read the pickles without the allow-list of classes (a pickle can run code: only for a copy you trust)",
    )
    args = ap.parse_args(argv)
    try:
        c = convert(args.images, args.pkl, args.out, args.val, args.test, args.seed, args.trust_pickles)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    s = c["splits"]
    print(
        f"{args.out}: {c['lines']} samples ({s['train']} train, {s['val']} val, {s['test']} test), {c['boxes']} boxes "
        f"from {c['images']} images; {c['negatives']} image-description pairs without a box left out; "
        f"{c['clipped']} boxes cut to their image, {c['dropped']} empty ones dropped"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
