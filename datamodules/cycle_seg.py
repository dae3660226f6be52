"""Referring-segmentation training data for CycleGRPO and its cold start: the released RL parquet and GRES, served.

`CycleSegDataModule` is `RECDataModule` (its validation / test sets, ``max_pixels``, ``max_train_samples``) with two
more training sources, concatenated in this order:

- ``parquet_files``: the released RL parquet (``datamodules/cycle_parquet.py``). A region row holds several targets;
  as the release (``verl/utils/dataset.py``: ``sample_single_target_from_multi_target(..., max_targets=1)``) each read
  serves **one target drawn at random**, here drawn from ``(seed, epoch, row)``, so a run and its mid-epoch resume see
  the same targets in the same order and two epochs see different targets of a row. The sample carries the target's
  code pair in ``meta["mask_codes"]`` (no box: decoding needs the mask tokenizer, which the method holds;
  ``methods/cycle_masks.py`` reads the codes for the ground truth, the captioning prompt and the token reward). A
  ``gres_no_target`` row is a query without a target (no boxes, ``meta["mask_codes"] == []``).
- ``gres``: GRES / gRefCOCO in its public layout (``datamodules/gres.py``, one sample per sentence): the exact pixel
  mask of the target (the union of its objects) in ``meta["mask"]``, the union box in ``boxes``; a no-target
  expression has neither.

No-target samples need nothing new: `CycleGRPO` grounds a sample without a target from its own query in a group of its
own (``no_target_groundings`` rows, rewarded for answering no target), as it does the toy world's ``train_nt`` split.
The training loader is always resumable (``datamodules.resumable``): its sampler hands the dataset ``(epoch, index)``
keys, which is how the target draw knows the epoch inside a loader worker.

``export_toy_parquet`` writes toy scenes in the released parquet's schema (images as files, targets' exact masks
encoded by a given mask tokenizer, a quarter of the rows ``gres_no_target``): the tests' fixture, and a way to run the
real-data configs without the real data.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from core.records import DataError, Sample
from core.regions.mask_tokens import format_mask
from core.toy.masks import object_masks
from datamodules.cycle_parquet import CycleRow, read_cycle_parquet, row_sample
from datamodules.gres import SegRecord, load_seg_sample, read_gres
from datamodules.rec import RECDataModule, Record, cap_pixels, load_sample
from datamodules.resumable import EpochSampler, ResumableLoader
from datamodules.toy import ToySceneDataset

__all__ = ["CycleSegDataModule", "CycleSegDataset", "EpochKeySampler", "GresFiles", "draw_target", "export_toy_parquet"]


def draw_target(row: CycleRow, seed: int, epoch: int, index: int) -> int | None:
    """The target a read of ``row`` (dataset index ``index``, epoch ``epoch``) serves; None for a no-target row."""
    if row.no_target:
        return None
    return random.Random(f"{seed}/{epoch}/{index}").randrange(len(row.codes))


@dataclass
class GresFiles:
    """GRES / gRefCOCO in its public layout (``datamodules/gres.py``; paths relative to ``--data.data_root``)."""

    grefs: str = "grefs(unc).json"
    instances: str = "instances.json"
    image_root: str = "train2014"
    split: str = "train"


class CycleSegDataset:
    """Parquet rows, then GRES records, then REC records; ``ds[(epoch, i)]`` (or ``ds[i]``: epoch 0) is a `Sample`."""

    def __init__(
        self,
        rows: list[CycleRow],
        records: list[SegRecord],
        rec: list[Record] | None = None,
        seed: int = 0,
        max_pixels: int | None = None,
    ):
        self.rows, self.seg, self.rec = rows, records, list(rec or [])
        self.seed, self.max_pixels = seed, max_pixels

    def __len__(self) -> int:
        return len(self.rows) + len(self.seg) + len(self.rec)

    @property
    def records(self) -> list[Record]:
        """The GRES and REC samples as `Record`s (the evaluator reads their task and boxes: ``[]`` is no target);
        parquet rows have no box before decoding and are left out (eval sets are GRES or REC)."""
        seg = [Record(r.sample_id, r.image_path, r.query, r.boxes, "rec", r.source, r.meta) for r in self.seg]
        return seg + self.rec

    def __getitem__(self, key: int | tuple[int, int]) -> Sample:
        epoch, i = key if isinstance(key, tuple) else (0, key)
        if i < len(self.rows):
            row = self.rows[i]
            s = row_sample(row, target=draw_target(row, self.seed, epoch, i))
            s.image, _ = cap_pixels(s.image, [], self.max_pixels)
            return s
        i -= len(self.rows)
        if i < len(self.seg):
            rec = self.seg[i]
            s = load_seg_sample(rec)
            if not rec.no_target:
                s.meta["mask"] = rec.mask()  # exact; cycle_masks fits it to a downscaled image
            s.image, s.boxes = cap_pixels(s.image, s.boxes, self.max_pixels)
            return s
        return load_sample(self.rec[i - len(self.seg)], self.max_pixels)


class EpochKeySampler(EpochSampler):
    """`EpochSampler` whose indices come as ``(epoch, index)``: the dataset's per-read draw is seeded by the epoch."""

    def __iter__(self) -> Iterator[tuple[int, int]]:
        epoch = self.epoch
        return ((epoch, i) for i in super().__iter__())


class CycleSegDataModule(RECDataModule):
    """`RECDataModule` that also trains on the released RL parquet and on GRES (module docstring).

    Args:
        parquet_files: released RL parquet files (relative to ``data_root``).
        parquet_image_root: the folder the rows' image paths (the release's ``./images/...``) start from; default each
            parquet file's folder.
        gres: GRES's refs, COCO instances and image folder, and the split trained on.
        gres_val_split: also validate / test on this GRES split (eval set ``gres_<split>``), with ``gres``'s files.
        (the rest: `RECDataModule`; ``train_files`` are REC JSONL lines served after the parquet and GRES samples)
    """

    def __init__(
        self,
        *args: Any,
        parquet_files: list[str] | None = None,
        parquet_image_root: str | None = None,
        gres: GresFiles | None = None,
        gres_val_split: str | None = None,
        **kwargs: Any,
    ):
        super().__init__(*args, **kwargs)
        self.parquet_files = list(parquet_files or [])
        self.parquet_image_root = parquet_image_root
        self.gres = gres
        if gres_val_split and gres is None:
            raise DataError(
                "--data.init_args.gres_val_split needs --data.init_args.gres (the refs and instances files)"
            )
        self.gres_val_split = gres_val_split

    def _gres_records(self, split: str, limit: int | None) -> list[SegRecord]:
        g = self.gres
        return read_gres(
            self._path(g.grefs), self._path(g.instances), self._path(g.image_root), split, max_samples=limit
        )

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit") and self.train_set is None and (self.parquet_files or self.gres):
            rows = [
                r
                for f in self.parquet_files
                for r in read_cycle_parquet(self._path(f), self.parquet_image_root or self._path(f).parent)
            ]
            seg = self._gres_records(self.gres.split, None) if self.gres else []
            rec = self._records(self.train_files, None) if self.train_files else []
            items = [("row", r) for r in rows] + [("seg", r) for r in seg] + [("rec", r) for r in rec]
            if self.max_train_samples is not None and len(items) > self.max_train_samples:
                items = random.Random(self.seed).sample(items, self.max_train_samples)
            pick = {k: [r for kind, r in items if kind == k] for k in ("row", "seg", "rec")}
            self.train_set = CycleSegDataset(pick["row"], pick["seg"], pick["rec"], self.seed, self.max_pixels)
        super().setup(stage)
        if self.gres_val_split:
            name = f"gres_{self.gres_val_split}"
            for kind in ("val", "test"):
                if stage is None or stage in {"val": ("fit", "validate"), "test": ("test", "predict")}[kind]:
                    if name not in self.eval_sets[kind]:
                        recs = self._gres_records(self.gres_val_split, self.max_eval_samples)
                        self.eval_sets[kind][name] = CycleSegDataset([], recs, max_pixels=self.max_pixels)

    def train_dataloader(self):
        if not isinstance(self.train_set, CycleSegDataset):
            return super().train_dataloader()
        trainer = self.trainer
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        sampler = EpochKeySampler(len(self.train_set), self.shuffle, self.seed, num_replicas=world, rank=rank)
        return ResumableLoader(
            self.train_set,
            batch_size=self.batch_size,
            sampler=sampler,
            num_workers=self.num_workers,
            collate_fn=self.train_collate,
            drop_last=False,
            persistent_workers=self.num_workers > 0,
        )


# --- the toy world in the released parquet's schema ----------------------------------------------------------------

_REGION_PROMPT = (
    "<image>\nCould you please give me a detailed description of the following regions? {spans}. Please respond "
    "with interleaved segmentation masks for the corresponding parts of the answer."
)


def export_toy_parquet(path: str | Path, codec: Any, n: int = 8, seed: int = 0, size: int = 224) -> Path:
    """Write ``n`` toy scenes as a released RL parquet file (module docstring) at ``path``, images under
    ``<path's folder>/images/`` (referenced as ``./images/<id>.png``). Rows ``i % 4 == 3`` are ``gres_no_target``
    rows (a ``train_nt`` scene whose query has no target, else the next one that has none); the others
    ``denseworld_multiple`` rows of the target and, on odd rows, one more object (two targets: one drawn per read).
    ``codec``: a mask tokenizer (``encode(image, mask, box) -> (c1, c2)``)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(path)
    (path.parent / "images").mkdir(parents=True, exist_ok=True)
    scenes = ToySceneDataset("train", 6 * n, seed, size, "rec", mix={"train_nt": 0.5})
    region = iter(s for s in (scenes[i] for i in range(len(scenes))) if s.boxes and s.meta.get("split") == "train")
    absent = iter(s for s in (scenes[i] for i in range(len(scenes))) if not s.boxes)
    rows = []
    for i in range(n):
        nt = i % 4 == 3
        s = next(absent if nt else region, None)
        if s is None:
            raise DataError(f"export_toy_parquet: fewer toy scenes of that kind than {n} rows need; lower n")
        name = f"images/{s.sample_id}.png"
        s.image.save(path.parent / name)
        if nt:
            rows.append(
                {
                    "images": [f"./{name}"],
                    "cap_problem": f"<image>\nPlease segment {s.query} in this image.",
                    "seg_answer": "<answer>No target.</answer>",
                    "source": "gres_no_target",
                }
            )
            continue
        masks = object_masks(s.meta)
        objs = s.meta["objects"]
        picked = [next(k for k, o in enumerate(objs) if o["role"] == "target")]
        if i % 2 and len(objs) > 1:
            picked.append(next(k for k in range(len(objs)) if k != picked[0]))
        spans = [format_mask(tuple(codec.encode(s.image, np.asarray(masks[k], dtype=bool), None))) for k in picked]
        rows.append(
            {
                "images": [f"./{name}"],
                "cap_problem": _REGION_PROMPT.format(spans=", ".join(spans)),
                "seg_answer": f"<answer>{', '.join(spans)}</answer>",
                "source": "denseworld_multiple",
            }
        )
    table = pa.Table.from_pylist(
        [{**r, "cap_answer": None, "seg_problem": None, "masks": None} for r in rows],
        schema=pa.schema(
            [
                ("images", pa.list_(pa.string())),
                ("cap_problem", pa.string()),
                ("seg_answer", pa.string()),
                ("source", pa.string()),
                ("cap_answer", pa.string()),
                ("seg_problem", pa.string()),
                ("masks", pa.string()),
            ]
        ),
    )
    pq.write_table(table, path)
    return path
