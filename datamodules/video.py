"""Temporal / spatio-temporal grounding data: the toy video world's JSONL (``datamodules/toy_video.py``), served as
`VideoSample`s to CycleGRPO's video path (``--model.method_args.region_space interval | anchor``).

A line (what ``python -m datamodules.toy_video`` writes)::

    {"id": "...", "video": "videos/x.npz", "conversations": [{"from": "human", "value": "<video>the ..."}, ...],
     "solution": [[2.0, 3.0]], "anchors": [[2.0, [x1, y1, x2, y2]], ...], "lookalikes": [[5.0, 6.0]],
     "fps": 2.0, "duration": 8.0, "width": 112, "height": 112, "task": "video"}

``solution`` holds the queried moment's intervals in seconds (empty: "no target"), ``anchors`` its (time, box) pairs
in frame pixels. Every defect raises ``DataError`` naming the file and line. `VideoGroundingDataModule` is
``RECDataModule`` with these records (same loaders, named eval sets, ``toy`` generation before reading).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from datamodules.rec import DataError, RECDataModule
from lightning_modules.qwen_vl import VideoClip
from lightning_modules.regions import NO_TARGET


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
    from datamodules.toy_video import load_frames

    obj = rec.raw
    try:
        frames = load_frames(obj, rec.root)
    except FileNotFoundError as err:
        raise DataError(
            f"{rec.source}: {err}; set --data.image_root to the folder the video paths start from"
        ) from None
    query = obj["conversations"][0]["value"].replace("<video>", "").strip()
    fps = float(obj["fps"])
    duration = float(obj.get("duration") or len(frames) / fps)
    intervals = [(float(s), float(e)) for s, e in obj["solution"]]
    if any(not 0 <= s < e <= duration + 1e-6 for s, e in intervals):
        raise DataError(f"{rec.source}: solution {obj['solution']} is not a list of [start, end] within the clip")
    return VideoSample(
        sample_id=str(obj.get("id", rec.source)),
        clip=VideoClip(frames, fps),
        query=query,
        intervals=intervals,
        anchors=[(float(t), tuple(float(v) for v in box)) for t, box in obj.get("anchors") or []],
        duration=duration,
        lookalikes=[(float(s), float(e)) for s, e in obj.get("lookalikes") or []],
        source=rec.source,
        meta=obj.get("meta") or {},
    )


class VideoDataset(Dataset):
    def __init__(self, records: Sequence[VideoRecord]):
        self.records = list(records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> VideoSample:
        return load_video_sample(self.records[i])


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
    ``train_no_target``: keep the training queries that have no target (off: CycleGRPO captions the ground-truth
    region, and a query without one has nothing to caption; validation keeps them, for ``n_acc``).
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
        train_no_target: bool = False,
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
            from datamodules.toy_video import export_jsonl

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
