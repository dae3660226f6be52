"""Temporal / spatio-temporal grounding data: the toy video world's JSONL (``datamodules/toy_video.py``), served as
`VideoSample`s to CycleGRPO's video path (``--model.method.init_args.region_space interval | anchor``).

A line (what ``python -m datamodules.toy_video`` writes)::

    {"id": "...", "video": "videos/x.npz", "conversations": [{"from": "human", "value": "<video>the ..."}, ...],
     "solution": [[2.0, 3.0]], "anchors": [[2.0, [x1, y1, x2, y2]], ...], "lookalikes": [[5.0, 6.0]],
     "fps": 2.0, "duration": 8.0, "width": 112, "height": 112, "task": "video"}

``solution`` holds the queried moment's intervals in seconds (empty: "no target"), ``anchors`` its (time, box) pairs
in frame pixels. Every defect raises ``DataError`` naming the file and line. `VideoGroundingDataModule` is
``RECDataModule`` with these records (same loaders, named eval sets, ``toy`` generation before reading).

`ImageVideoSFTDataModule` serves the video SFT stage of the cycle checkpoint: the toy image world's training scenes
and fresh toy clips (`ToyClipDataset`), in batches that are all images or all clips (`MixedBatches`).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Dataset

from core.records import DataError
from core.regions import NO_TARGET
from core.video import VideoClip
from datamodules.rec import RECDataModule, ToySpec
from datamodules.toy_video import _check_args, export_jsonl, jsonl_path, load_frames, make_clip


@dataclass
class VideoSample:
    """One temporal / spatio-temporal grounding example."""

    sample_id: str
    clip: VideoClip
    query: str
    intervals: list[tuple[float, float]]
    """The queried moment in seconds (empty: no target)."""
    anchors: list[tuple[float, tuple[float, ...]]]
    """``(t, [x1, y1, x2, y2])`` of the queried object on the moment's frames, in frame pixels."""
    duration: float
    lookalikes: list[tuple[float, float]] = field(default_factory=list)
    task: str = "video"
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def image(self) -> VideoClip:
        """The visual input of the sample's prompts (a clip; the name is the rollout requests' field)."""
        return self.clip

    @property
    def size(self) -> tuple[int, int]:
        return self.clip.size

    @property
    def boxes(self) -> list[list[float]]:
        """No single box: box callbacks and REC metrics see nothing to draw."""
        return []

    def region(self, space: str) -> Any:
        """The ground-truth region in ``space`` (``interval`` or ``anchor``), ``NO_TARGET`` when the query has none."""
        if space == "interval":
            return tuple(self.intervals) or NO_TARGET
        if space == "anchor":
            return tuple(self.anchors) or NO_TARGET
        raise ValueError(f"a video sample has interval and anchor regions, not {space!r}")

    def lookalike_regions(self, space: str) -> list[Any]:
        """The queried actor's other moves as regions of ``space``: where a caption that names only the kind of event
        grounds (``Locatability``). ``interval``: one region per move; ``anchor``: the actor's (time, box) on each of
        the move's frames, read from the toy world's per-frame boxes (``meta["objects"][0]["boxes"]``); none for a
        record without them (the look-alikes then count as absent, so confusion reads 0)."""
        if space == "interval":
            return [((s, e),) for s, e in self.lookalikes]
        if space != "anchor":
            raise ValueError(f"a video sample has interval and anchor regions, not {space!r}")
        objects = self.meta.get("objects") or [{}]
        boxes, fps = objects[0].get("boxes"), float(self.meta.get("fps") or self.clip.fps)
        if not boxes:
            return []
        return [
            tuple((f / fps, tuple(float(v) for v in boxes[f])) for f in range(round(s * fps), round(e * fps) + 1))
            for s, e in self.lookalikes
            if round(e * fps) < len(boxes)
        ]


@dataclass
class VideoRecord:
    """A parsed JSONL line before its frames are loaded."""

    raw: dict[str, Any]
    root: Path
    source: str
    task: str = "video"


def read_video_jsonl(path: str | Path, root: str | Path | None = None) -> list[VideoRecord]:
    """Parse a video JSONL file (frames are not loaded here); ``root``: where ``video`` paths are relative to."""
    path = Path(path)
    if not path.exists():
        raise DataError(
            f"{path}: no such data file; check --data.train_files / val_files / test_files (or set --data.toy)"
        )
    base = Path(root) if root is not None else path.parent
    out = []
    for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        where = f"{path}:{lineno}"
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            raise DataError(f"{where}: not valid JSON ({err.msg} at column {err.pos + 1})") from None
        missing = [k for k in ("video", "solution", "fps", "conversations") if k not in obj]
        if missing:
            raise DataError(
                f"{where}: missing {missing}; a video line needs video, solution, fps and conversations "
                "(python -m datamodules.toy_video writes them)"
            )
        out.append(VideoRecord(obj, base, where))
    if not out:
        raise DataError(f"{path}: no samples in the file")
    return out


def load_video_sample(rec: VideoRecord) -> VideoSample:
    try:
        frames = load_frames(rec.raw, rec.root)
    except FileNotFoundError as err:
        raise DataError(
            f"{rec.source}: {err}; set --data.image_root to the folder the video paths start from"
        ) from None
    return video_sample(rec.raw, frames, rec.source)


def video_sample(obj: dict[str, Any], frames: Sequence[Any], source: str) -> VideoSample:
    """A `VideoSample` from a JSONL line (or a ``toy_video.make_clip`` record) and its frames."""
    query = obj["conversations"][0]["value"].replace("<video>", "").strip()
    fps = float(obj["fps"])
    duration = float(obj.get("duration") or len(frames) / fps)
    intervals = [(float(s), float(e)) for s, e in obj["solution"]]
    if any(not 0 <= s < e <= duration + 1e-6 for s, e in intervals):
        raise DataError(f"{source}: solution {obj['solution']} is not a list of [start, end] within the clip")
    return VideoSample(
        sample_id=str(obj.get("id", source)),
        clip=VideoClip(list(frames), fps),
        query=query,
        intervals=intervals,
        anchors=[(float(t), tuple(float(v) for v in box)) for t, box in obj.get("anchors") or []],
        duration=duration,
        lookalikes=[(float(s), float(e)) for s, e in obj.get("lookalikes") or []],
        source=source,
        meta=obj.get("meta") or {},
    )


class VideoDataset(Dataset):
    def __init__(self, records: Sequence[VideoRecord]):
        self.records = list(records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> VideoSample:
        return load_video_sample(self.records[i])


class ToyClipDataset(Dataset):
    """Clips of a toy video split rendered on access (index -> ``toy_video.make_clip``), as `VideoSample`s: the
    clips ``toy_video.export_jsonl`` writes, without the npz round trip (the video counterpart of
    ``datamodules.toy.ToySceneDataset``: a long SFT run draws fresh clips in its loader workers)."""

    def __init__(self, split: str, n: int, seed: int, size: int = 112, num_frames: int = 16, fps: float = 2.0):
        _check_args(split, size, num_frames, fps)
        self.split, self.n, self.seed = split, n, seed
        self.size, self.num_frames, self.fps = size, num_frames, fps

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> VideoSample:
        if not 0 <= index < self.n:
            raise IndexError(f"clip {index} out of range for {self.n} {self.split} clips")
        rec = make_clip(self.split, index, self.seed, self.size, self.num_frames, self.fps)
        return video_sample(rec, rec.pop("frames"), f"toy_video:{self.split}:{index}")


@dataclass
class ToyVideoSpec:
    """Generate the toy video world into ``--data.data_root`` before reading it (``datamodules.toy_video``)."""

    splits: dict[str, int] = field(default_factory=lambda: {"train": 64, "val": 32})
    seed: int = 0
    size: int = 112
    num_frames: int = 16
    fps: float = 2.0


class VideoGroundingDataModule(RECDataModule):
    """Video grounding JSONL (``*_video.jsonl``): a train set and named val / test sets, as ``RECDataModule``.

    Args (those of ``RECDataModule`` except): ``toy``: a `ToyVideoSpec` (export the toy video world into
    ``data_root`` first); ``image_root``: where ``video`` paths are relative to (default: each file's folder);
    ``train_no_target``: keep the training queries that have no target (CycleGRPO grounds them from their query,
    rewarded for answering ``no target``; off: only the clips with a target region train, which unlearns the rejection;
    validation always keeps them, for ``n_acc``).
    """

    def __init__(
        self,
        data_root: str = "data/toy_video",
        train_files: list[str] | None = None,
        val_files: dict[str, str] | None = None,
        test_files: dict[str, str] | None = None,
        image_root: str | None = None,
        batch_size: int = 2,
        eval_batch_size: int = 8,
        max_train_samples: int | None = None,
        max_eval_samples: int | None = None,
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        toy: ToyVideoSpec | None = None,
        train_no_target: bool = True,
    ):
        super().__init__(
            data_root=data_root,
            train_files=train_files,
            val_files=val_files,
            test_files=test_files,
            image_root=image_root,
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            max_train_samples=max_train_samples,
            max_eval_samples=max_eval_samples,
            num_workers=num_workers,
            shuffle=shuffle,
            seed=seed,
        )
        self.toy = toy
        self.train_no_target = train_no_target

    def prepare_data(self) -> None:
        if self.toy is not None:
            t = self.toy
            for split, n in t.splits.items():
                export_jsonl(self.data_root, split, n, t.seed, size=t.size, num_frames=t.num_frames, fps=t.fps)

    def _records(self, files: Sequence[str], limit: int | None) -> list[VideoRecord]:
        out: list[VideoRecord] = []
        for f in files:
            out += read_video_jsonl(self._path(f), self.image_root)
        return out if limit is None else out[:limit]  # the toy splits are random already; a prefix is reproducible

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit") and self.train_set is None and self.train_files:
            records = self._records(self.train_files, None)
            if not self.train_no_target:
                records = [r for r in records if r.raw["solution"]]
            if self.max_train_samples is not None:
                records = records[: self.max_train_samples]
            if not records:
                raise DataError(f"no training clip with a target in {self.train_files} (--data.train_no_target false)")
            self.train_set = VideoDataset(records)
        for kind, files in (("val", self.val_files), ("test", self.test_files)):
            if stage is None or stage in {"val": ("fit", "validate"), "test": ("test", "predict")}[kind]:
                for name, f in files.items():
                    if name not in self.eval_sets[kind]:
                        self.eval_sets[kind][name] = VideoDataset(self._records([f], self.max_eval_samples))


# --- image + clip SFT ------------------------------------------------------------------------------------------------


@dataclass
class ClipMixSpec:
    """Toy clips mixed into an image SFT run (`ImageVideoSFTDataModule`): the training clips are rendered on access,
    the validation clips exported into ``--data.data_root`` (``toy_video.export_jsonl``) and read as eval set
    ``val_name``."""

    frac: float = 0.5
    """Fraction of the training batches that are clip batches (fixed by batch index, seeded: `MixedBatches`)."""
    train: int = 1_000_000
    val: int = 16
    val_name: str = "toy_video_val"
    batch_size: int | None = None
    """Clips per clip batch (None: ``--data.batch_size``, the image batch's size)."""
    seed: int = 0
    size: int = 112
    num_frames: int = 16
    fps: float = 2.0


class MixedBatches(Dataset):
    """Whole training batches, each all images or all clips. Item ``j`` is a clip batch when the seeded sequence
    ``floor(j * frac + u)`` (``u`` uniform in [0, 1), drawn from ``seed``) steps at ``j``: any ``n`` consecutive
    indices hold ``floor(n * frac)`` or ``ceil(n * frac)`` clip batches, so even a small epoch gets its share
    (independent draws per index could give a two-batch epoch no clip at all). A run shorter than an epoch, with the
    loader's shuffle, sees a random subset of the indices: about ``frac`` of its steps are clip batches, not exactly
    (4,000 steps of a 62,500-batch epoch at 0.5: 2,000 +- ~30). A batch holds samples
    ``j * size .. j * size + size - 1`` of its pool (modulo the pool's length).

    Homogeneous batches because one forward (and one processor call) takes images or clips, not both
    (``qwen_vl.processor_inputs``); fixed by batch index, so the mix does not depend on the loader's order or
    workers, and no sample is seen twice an epoch while the pools are longer than the epoch (the toy pools hold a
    million renders, in random order already: consecutive indices are independent scenes). The loader shuffles the
    batch indices (``batch_size=None``), and under DDP each rank takes its own batch indices."""

    def __init__(self, images, clips, image_batch: int, clip_batch: int, frac: float, seed: int = 0):
        if not 0.0 <= frac <= 1.0:
            raise ValueError(f"--data.video.frac must lie in [0, 1], got {frac}")
        if image_batch < 1 or clip_batch < 1:
            raise ValueError(f"batch sizes must be >= 1, got {image_batch} (images) and {clip_batch} (clips)")
        if (frac < 1 and not len(images)) or (frac > 0 and not len(clips)):
            raise DataError(f"an empty pool: {len(images)} training images, {len(clips)} clips, clip fraction {frac}")
        self.images, self.clips, self.frac, self.seed = images, clips, frac, seed
        self.phase = float(np.random.default_rng([seed, _MIX_SEED_TAG]).random())
        self.image_batch, self.clip_batch = image_batch, clip_batch
        n = (1 - frac) * len(images) / image_batch + frac * len(clips) / clip_batch
        self.n = max(1, math.ceil(n))
        """Batches per epoch: as many as the two pools fill at the mix's proportions."""

    def __len__(self) -> int:
        return self.n

    def is_clip_batch(self, j: int) -> bool:
        return math.floor((j + 1) * self.frac + self.phase) > math.floor(j * self.frac + self.phase)

    def __getitem__(self, j: int) -> list:
        pool, size = (self.clips, self.clip_batch) if self.is_clip_batch(j) else (self.images, self.image_batch)
        return [pool[(j * size + k) % len(pool)] for k in range(size)]


_MIX_SEED_TAG = 4242
"""Enters the seed of `MixedBatches`' phase (no other draw of the toy worlds uses it)."""


class ImageVideoSFTDataModule(RECDataModule):
    """``RECDataModule`` (the toy image world of the SFT stages) plus toy clips (``video``: a `ClipMixSpec`): training
    batches are all images or all clips (`MixedBatches`), validation adds the clips as one more eval set. For the
    video SFT stage of the cycle checkpoint (``SFTModule`` teaches both region spaces of CycleGRPO's video path on
    the clips, docs/cycle_grpo.md). Without ``video`` it is ``RECDataModule``."""

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
        video: ClipMixSpec | None = None,
    ):
        super().__init__(
            data_root=data_root,
            train_files=train_files,
            val_files=val_files,
            test_files=test_files,
            image_root=image_root,
            batch_size=batch_size,
            eval_batch_size=eval_batch_size,
            max_train_samples=max_train_samples,
            max_eval_samples=max_eval_samples,
            num_workers=num_workers,
            shuffle=shuffle,
            seed=seed,
            toy=ToySpec(**toy) if isinstance(toy, dict) else toy,
            resumable=resumable,
        )
        self.video = ClipMixSpec(**video) if isinstance(video, dict) else video
        self.clip_set: ToyClipDataset | None = None

    def prepare_data(self) -> None:
        super().prepare_data()
        if self.video is not None and self.video.val:
            v = self.video
            export_jsonl(self.data_root, "val", v.val, v.seed, size=v.size, num_frames=v.num_frames, fps=v.fps)

    def setup(self, stage: str | None = None) -> None:
        super().setup(stage)
        v = self.video
        if v is None:
            return
        if stage in (None, "fit") and self.clip_set is None:
            self.clip_set = ToyClipDataset("train", v.train, v.seed, v.size, v.num_frames, v.fps)
        if v.val and stage in (None, "fit", "validate") and v.val_name not in self.eval_sets["val"]:
            records = read_video_jsonl(jsonl_path(self.data_root, "val"), self.image_root)
            limit = v.val if self.max_eval_samples is None else min(v.val, self.max_eval_samples)
            self.eval_sets["val"][v.val_name] = VideoDataset(records[:limit])

    def train_dataloader(self):
        v = self.video
        if v is None or v.frac == 0:
            return super().train_dataloader()
        if self.train_set is None or self.clip_set is None:
            self.setup("fit")
        if self.resumable:
            raise ValueError("--data.resumable is not wired for mixed image / clip batches; leave it false")
        images = self.train_set if self.train_set is not None else []
        batches = MixedBatches(images, self.clip_set, self.batch_size, v.batch_size or self.batch_size, v.frac, v.seed)
        return DataLoader(
            batches,
            batch_size=None,  # an item is a whole batch
            shuffle=self.shuffle,
            num_workers=self.num_workers,
            collate_fn=self.train_collate,
            persistent_workers=self.num_workers > 0,
        )
