"""REC and OVD JSONL readers (VLM-R1's format) and the Lightning data module that serves them.

A line::

    {"id": "...", "image": "rel/path.jpg", "conversations": [{"from": "human", "value": "<image>the red mug"}, ...],
     "solution": [x1, y1, x2, y2], "task": "rec"}

``solution`` is in original pixels: one box for REC, a list of boxes for OVD. The query is the human turn without
``<image>`` (``problem`` is accepted too). Every defect (bad JSON, missing key, missing image, empty or out-of-image
box) raises ``DataError`` naming the file and line.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from core.records import DataError, Sample
from datamodules.resumable import EpochSampler, ResumableLoader
from datamodules.toy import ToySceneDataset, export_jsonl, export_offline_descriptions


@dataclass
class Record:
    """A parsed JSONL line before its image is loaded."""

    sample_id: str
    image_path: Path
    query: str
    boxes: list[list[float]]
    task: str
    source: str
    meta: dict[str, Any]


def _query_from(obj: dict, where: str) -> str:
    if isinstance(obj.get("problem"), str):
        return obj["problem"].replace("<image>", "").strip()
    conv = obj.get("conversations")
    if isinstance(conv, list):
        for turn in conv:
            if isinstance(turn, dict) and turn.get("from") in ("human", "user") and isinstance(turn.get("value"), str):
                return turn["value"].replace("<image>", "").strip()
    raise DataError(f"{where}: no query: expected a 'conversations' list with a human turn, or a 'problem' string")


def _boxes_from(solution: Any, task: str, where: str) -> list[list[float]]:
    def as_box(b: Any) -> list[float]:
        if isinstance(b, dict) and "bbox_2d" in b:
            b = b["bbox_2d"]
        if not (isinstance(b, list | tuple) and len(b) == 4 and all(isinstance(v, int | float) for v in b)):
            raise DataError(f"{where}: 'solution' must hold boxes [x1, y1, x2, y2] of 4 numbers; got {b!r}")
        box = [float(v) for v in b]
        if not all(math.isfinite(v) for v in box):
            raise DataError(f"{where}: box {b!r} has a non-finite coordinate")
        if box[2] <= box[0] or box[3] <= box[1]:
            raise DataError(f"{where}: empty box {b!r}: need x2 > x1 and y2 > y1 (original pixels, xyxy)")
        return box

    if solution is None:
        raise DataError(f"{where}: missing 'solution' (the ground-truth box in original pixels)")
    if task == "rec":
        if isinstance(solution, list) and not solution:  # a no-target query (GRES-style): nothing to find
            return []
        if isinstance(solution, list) and len(solution) == 1 and isinstance(solution[0], list | dict):
            solution = solution[0]
        return [as_box(solution)]
    if isinstance(solution, list) and solution and isinstance(solution[0], int | float):
        return [as_box(solution)]
    if not isinstance(solution, list) or not solution:
        raise DataError(f"{where}: OVD 'solution' must be a non-empty list of boxes")
    return [as_box(b) for b in solution]


def read_jsonl(
    path: str | Path, image_root: str | Path | None = None, *, task: str | None = None, max_samples: int | None = None
) -> list[Record]:
    """Parse a REC / OVD JSONL file into records (images are not opened here)."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: no such data file; check --data.train_files / val_files / test_files")
    root = Path(image_root) if image_root is not None else path.parent
    records: list[Record] = []
    with path.open("rb") as fh:  # bytes: a bad line is then reported with its file and line, not as a bare codec error
        for lineno, raw in enumerate(fh, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(
                    f"{where}: not UTF-8 (byte {raw[err.start : err.start + 1]!r} at column {err.start + 1}); "
                    "JSONL files must be UTF-8: re-encode the file (e.g. iconv -f latin1 -t utf-8)"
                ) from None
            line = line.rstrip("\r\n")  # else an error at the end of the line is reported at column 1 of the next
            if lineno == 1:
                line = line.removeprefix("\ufeff")  # a byte-order mark written by some editors
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not valid JSON ({err.msg} at column {err.pos + 1})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{where}: expected a JSON object per line")
            image = obj.get("image")
            if isinstance(image, list) and len(image) == 1:
                image = image[0]
            if not isinstance(image, str) or not image:
                raise DataError(f"{where}: missing 'image' (a path relative to the image root {root})")
            t = task or obj.get("task", "rec")
            if t not in ("rec", "ovd"):
                raise DataError(f"{where}: 'task' must be 'rec' or 'ovd'; got {t!r}")
            records.append(
                Record(
                    sample_id=str(obj.get("id", f"{path.stem}-{lineno}")),
                    image_path=root / image,
                    query=_query_from(obj, where),
                    boxes=_boxes_from(obj.get("solution"), t, where),
                    task=t,
                    source=where,
                    meta=obj.get("meta") or {},
                )
            )
            if max_samples is not None and len(records) >= max_samples:
                break
    if not records:
        raise DataError(f"{path}: no samples in the file")
    return records


def cap_pixels(image: Image.Image, boxes: list[list[float]], max_pixels: int | None):
    """Downscale ``image`` (aspect kept) to at most ``max_pixels`` pixels and its boxes with it; else unchanged."""
    w, h = image.size
    if max_pixels is None or w * h <= max_pixels:
        return image, boxes
    s = math.sqrt(max_pixels / (w * h))
    w2, h2 = max(1, math.floor(w * s)), max(1, math.floor(h * s))
    sx, sy = w2 / w, h2 / h
    return image.resize((w2, h2), Image.BICUBIC), [[b[0] * sx, b[1] * sy, b[2] * sx, b[3] * sy] for b in boxes]


def load_sample(rec: Record, max_pixels: int | None = None) -> Sample:
    """Open the record's image and check its boxes against the image size; with ``max_pixels``, downscale an image
    larger than that (and its boxes, so they stay exact) before the processor sees it."""
    if not rec.image_path.exists():
        raise DataError(
            f"{rec.source}: image {rec.image_path} not found; set --data.image_root to the folder that holds the images"
        )
    with Image.open(rec.image_path) as im:
        image = im.convert("RGB")
    w, h = image.size
    for b in rec.boxes:
        if b[0] < 0 or b[1] < 0 or b[2] > w + 0.5 or b[3] > h + 0.5:
            raise DataError(f"{rec.source}: box {b} lies outside the {w}x{h} image {rec.image_path}")
    image, boxes = cap_pixels(image, [list(b) for b in rec.boxes], max_pixels)
    return Sample(
        sample_id=rec.sample_id,
        image=image,
        query=rec.query,
        boxes=boxes,
        task=rec.task,
        image_path=str(rec.image_path),
        source=rec.source,
        meta=dict(rec.meta),
    )


class GroundingDataset(Dataset):
    """Records of one or more JSONL files; images load on access."""

    def __init__(self, records: Sequence[Record], max_pixels: int | None = None):
        self.records = list(records)
        self.max_pixels = max_pixels

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> Sample:
        return load_sample(self.records[i], self.max_pixels)


def collate_samples(batch: list[Sample]) -> list[Sample]:
    """Keep PIL images and boxes as they are: the processor does the tensor work at rollout time."""
    return list(batch)


@dataclass
class ToySpec:
    """Generate the procedural toy world into ``--data.data_root`` before reading it."""

    splits: dict[str, int] = field(default_factory=lambda: {"train": 64, "val": 32, "ood": 32})
    """Split name -> number of scenes (train / val are in-domain, ood out-of-domain)."""
    seed: int = 0
    task: str = "rec"
    size: int = 224
    render_train: bool = False
    """Render the ``train`` split on access in the loader workers instead of exporting it (``ToySceneDataset``):
    for long SFT runs on many scenes. The other splits are still exported as JSONL."""
    mix: dict[str, float] = field(default_factory=dict)
    """With ``render_train``: fractions of the training scenes drawn from other splits, e.g. ``{varied: 0.5}``
    (``datamodules.toy.SPLITS``: ``solo`` and ``varied`` exist for SFT)."""
    evolve: float = 0.0
    """With ``render_train``: fraction of the training scenes served in an evolved version (``datamodules.evolve``:
    ``toy.EVOLVE_LEVELS``, text edits three times in four, half of them in their sub-problem version), for the SFT
    stage that teaches EvolvedGRPO's step format."""


class RECDataModule(L.LightningDataModule):
    """REC / OVD JSONL data: a train set, and several named validation / test sets (one metric prefix each).

    Args:
        data_root: folder the file names below are relative to (and the image root unless ``image_root`` is set).
        train_files: JSONL files read as one training set.
        val_files: name -> JSONL file, e.g. ``{refcoco_val: refcoco_val.jsonl, lisa_test: lisa_test.jsonl}``.
        test_files: as ``val_files``, for ``train.py test``.
        image_root: where image paths in the JSONL are relative to (default: each file's folder).
        batch_size: prompts per training step (the paper's 20).
        eval_batch_size: prompts per validation / test batch.
        max_train_samples: cap the training set: a random sample drawn with ``seed`` over the union of
            ``train_files`` (the paper, after VLM-R1: 2,000 from RefCOCO, RefCOCO+ and RefCOCOg together). The drawn
            ids go to ``<run folder>/data/train_sample_ids.json`` at setup (rank 0). An example in two files counts
            once; another example under an id an earlier file has becomes ``<file stem>:<id>``.
        max_pixels: downscale any image above this many pixels (aspect kept, boxes scaled with it) before the
            processor sees it: bounds the vision tokens of extended canvases (Qwen2.5-VL: one token per 28 x 28 px,
            so 1,003,520 px = 1,280 tokens). None: no cap here (the processor's own max_pixels still applies).
        toy: generate the procedural toy world into ``data_root`` first (the embedded default).
        resumable: serve training batches through ``datamodules.resumable.ResumableLoader``: the order depends only on
            ``seed`` and the epoch, and a run resumed from a mid-epoch checkpoint sees exactly the batches an
            uninterrupted run would. Off here by default (it changes the shuffle order, and the toy SFT checkpoint
            is rebuilt bit for bit with the old one); ``SyntheticDataModule`` turns it on.
    """

    def __init__(
        self,
        data_root: str = "data",
        train_files: list[str] | None = None,
        val_files: dict[str, str] | None = None,
        test_files: dict[str, str] | None = None,
        image_root: str | None = None,
        batch_size: int = 20,
        eval_batch_size: int = 8,
        max_train_samples: int | None = None,
        max_eval_samples: int | None = None,
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        toy: ToySpec | None = None,
        resumable: bool = False,
        max_pixels: int | None = None,
    ):
        super().__init__()
        self.data_root = Path(data_root)
        self.train_files = list(train_files or [])
        self.val_files = dict(val_files or {})
        self.test_files = dict(test_files or {})
        self.image_root = image_root
        self.batch_size = batch_size
        self.eval_batch_size = eval_batch_size
        self.max_train_samples = max_train_samples
        self.max_eval_samples = max_eval_samples
        self.num_workers = num_workers
        self.shuffle = shuffle
        self.seed = seed
        self.toy = toy
        self.resumable = resumable
        if max_pixels is not None and max_pixels < 28 * 28 * 4:
            raise DataError(f"--data.max_pixels must be at least {28 * 28 * 4} (4 vision tokens); got {max_pixels}")
        self.max_pixels = max_pixels
        if toy is not None and not toy.render_train and (toy.mix or toy.evolve):
            key = "mix" if toy.mix else "evolve"
            raise DataError(
                f"--data.init_args.toy.{key} applies to a rendered train split only: the exported train.jsonl is "
                f"one split, and {key} would be ignored; add --data.init_args.toy.render_train=true"
            )
        self.train_set: GroundingDataset | None = None
        self.train_collate = collate_samples
        """Set by a module that prepares its inputs in the loader workers (``SFTModule``)."""
        self.eval_sets: dict[str, dict[str, GroundingDataset]] = {"val": {}, "test": {}}

    def prepare_data(self) -> None:
        if self.toy is not None:
            for split, n in self.toy.splits.items():
                if split == "train" and self.toy.render_train:
                    continue
                export_jsonl(self.data_root, split, n, seed=self.toy.seed, task=self.toy.task, size=self.toy.size)
            if "train" in self.toy.splits and not self.toy.render_train:  # for the "GRPO + Offline Generation" baseline
                export_offline_descriptions(self.data_root, "train", seed=self.toy.seed, task=self.toy.task)

    def _path(self, name: str) -> Path:
        p = Path(name)
        return p if p.is_absolute() else self.data_root / p

    def _records(self, files: Sequence[str], limit: int | None) -> list[Record]:
        out: list[Record] = []
        seen: dict[str, Record] = {}
        for f in files:  # read everything, then sample: the paper's 2,000 are a random sample, not the first lines
            for r in read_jsonl(self._path(f), self.image_root):
                if (first := seen.get(r.sample_id)) is not None:
                    if (first.image_path, first.query, first.boxes) == (r.image_path, r.query, r.boxes):
                        continue  # the same example in two files: once
                    r.sample_id = f"{Path(f).stem}:{r.sample_id}"  # another example under an id an earlier file has
                seen.setdefault(r.sample_id, r)
                out.append(r)
        if limit is not None and len(out) > limit:
            out = random.Random(self.seed).sample(out, limit)
        return out

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit") and self.train_set is None and self.toy is not None and self.toy.render_train:
            n = self.toy.splits.get("train", 0)
            if self.max_train_samples is not None:
                n = min(n, self.max_train_samples)
            self.train_set = ToySceneDataset(
                "train", n, self.toy.seed, self.toy.size, self.toy.task, mix=self.toy.mix, evolve=self.toy.evolve
            )
        elif stage in (None, "fit") and self.train_set is None and self.train_files:
            self.train_set = GroundingDataset(self._records(self.train_files, self.max_train_samples), self.max_pixels)
            self._write_sample_ids()
        for kind, files in (("val", self.val_files), ("test", self.test_files)):
            if stage is None or stage in {"val": ("fit", "validate"), "test": ("test", "predict")}[kind]:
                for name, f in files.items():
                    if name not in self.eval_sets[kind]:
                        self.eval_sets[kind][name] = GroundingDataset(
                            self._records([f], self.max_eval_samples), self.max_pixels
                        )

    def _write_sample_ids(self) -> Path | None:
        """Write the drawn training ids, per file, to ``<run folder>/data/train_sample_ids.json`` (rank 0, once)."""
        trainer = self.trainer
        if trainer is None or not trainer.is_global_zero or self.train_set is None:
            return None
        out = Path(trainer.default_root_dir) / "data" / "train_sample_ids.json"
        if out.exists():  # a resumed run: the draw is the same (same files, seed and cap); keep the first record
            return out
        per_file: dict[str, list[str]] = {f: [] for f in self.train_files}
        for r in self.train_set.records:
            per_file[next(f for f in self.train_files if r.source.startswith(f"{self._path(f)}:"))].append(r.sample_id)
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = {
            "seed": self.seed,
            "max_train_samples": self.max_train_samples,
            "num_samples": len(self.train_set.records),
            "ids": [r.sample_id for r in self.train_set.records],
            "per_file": {f: {"count": len(v), "ids": v} for f, v in per_file.items()},
        }
        out.write_text(json.dumps(doc, indent=1) + "\n")
        return out

    def _train_set(self):
        if self.train_set is None:
            self.setup("fit")
        if self.train_set is None:
            raise DataError("no training data: set --data.train_files (or --data.toy for the toy world)")
        return self.train_set

    def train_samples(self, limit: int | None = None):
        """The first ``limit`` training samples (images loaded or rendered), in order."""
        ds = self._train_set()
        return (ds[i] for i in range(len(ds) if limit is None else min(limit, len(ds))))

    def train_records(self) -> list[Record]:
        ds = self._train_set()
        if not hasattr(ds, "records"):
            raise DataError(
                "the train split is rendered on access (--data.toy.render_train: true), so it has no "
                "JSONL records; set render_train: false to export it, or use train_samples()"
            )
        return ds.records

    def _resumable_loader(self, dataset, collate_fn, persistent_workers: bool = True):
        # LightningDataModule's attribute (``_trainer`` does not exist: every rank read rank 0's shard)
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        return ResumableLoader(
            dataset,
            batch_size=self.batch_size,
            sampler=EpochSampler(len(dataset), shuffle=self.shuffle, seed=self.seed, num_replicas=world, rank=rank),
            num_workers=self.num_workers,
            collate_fn=collate_fn,
            drop_last=False,
            persistent_workers=persistent_workers and self.num_workers > 0,
        )

    def train_dataloader(self):
        if self.train_set is None:
            raise DataError("no training data: set --data.train_files (or --data.toy for the toy world)")
        if self.resumable:
            return self._resumable_loader(self.train_set, self.train_collate)
        return DataLoader(
            self.train_set,
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            num_workers=self.num_workers,
            collate_fn=self.train_collate,
            drop_last=False,
            persistent_workers=self.num_workers > 0,
        )

    def _eval_loaders(self, kind: str):
        sets = self.eval_sets[kind]
        return [
            DataLoader(
                ds,
                batch_size=self.eval_batch_size,
                shuffle=False,
                num_workers=self.num_workers,
                collate_fn=collate_samples,
            )
            for ds in sets.values()
        ]

    def eval_names(self, kind: str) -> list[str]:
        return list(self.eval_sets[kind])

    def val_dataloader(self):
        return self._eval_loaders("val")

    def test_dataloader(self):
        return self._eval_loaders("test")

    def predict_dataloader(self):  # train.py predict answers the test sets (callbacks.predictions writes them)
        return self._eval_loaders("test")
