"""SyntheticDataModule and DataPool: the training data that co-evolves with the model.

Every sample keeps its original (image, boxes, query) and a current version with lineage: which epoch made it, from
which description, from which parent version, by which job. The train dataloader reads current versions, so an image
swapped in at an epoch boundary is what the next epoch trains on. The pool is part of the checkpoint
(``state_dict`` / ``load_state_dict``), so a resumed run continues the evolution instead of restarting it.

A sample's identity (``sample_id``) never changes; its versions do. A version changes the image (Syn-GRPO: its
background repainted; the boxes travel with the image and change only if the data server extends the canvas), the
question (instruction evolution: ``query``, with the difficulty ``level`` it carries), or both; a version that does
not set one keeps its parent's.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader, Dataset

from core.records import DataError
from datamodules.rec import RECDataModule, Record, collate_samples, load_sample


@dataclass
class Version:
    """One version of a sample (image, boxes and, when edited, question). Version 0 is the original."""

    version: int
    image_path: str
    boxes: list[list[float]]
    epoch: int = 0
    """The first (0-based) training epoch that trains on it: a version painted from epoch e's descriptions is swapped
    in at e's end with ``epoch = e + 1`` (0 for the original)."""
    description: str | None = None
    parent: int | None = None
    job_id: str | None = None
    query: str | None = None
    """The question of this version (``None``: the record's original question)."""
    level: int = 0
    """Difficulty level of the question (instruction evolution; 0: the original)."""
    scene: dict[str, Any] | None = None
    """The toy scene this version's image shows, when a visual edit changed it (``None``: the record's)."""


@dataclass
class PoolEntry:
    record: Record
    versions: list[Version] = field(default_factory=list)

    @property
    def current(self) -> Version:
        return self.versions[-1]


class DataPool:
    """Samples by ``sample_id``, each with its lineage of image versions."""

    def __init__(self, records: list[Record]):
        self._entries: dict[str, PoolEntry] = {}
        for r in records:
            if r.sample_id in self._entries:
                raise DataError(
                    f"{r.source}: duplicate sample id {r.sample_id!r} (also at "
                    f"{self._entries[r.sample_id].record.source}); ids must be unique in the pool"
                )
            self._entries[r.sample_id] = PoolEntry(r, [Version(0, str(r.image_path), [list(b) for b in r.boxes])])
        self.order = list(self._entries)
        """Sample ids in the training data's order (what :meth:`record` indexes)."""

    def __len__(self) -> int:
        return len(self.order)

    def __contains__(self, sample_id: str) -> bool:
        return sample_id in self._entries

    def current(self, sample_id: str) -> Version:
        return self._entries[sample_id].current

    def original(self, sample_id: str) -> Version:
        return self._entries[sample_id].versions[0]

    def lineage(self, sample_id: str) -> list[Version]:
        return list(self._entries[sample_id].versions)

    def base_record(self, sample_id: str) -> Record:
        """The sample's record as the training data gave it: its original question and its ``meta`` (a toy sample's
        scene), which every version's edits start from. Read it, never change it."""
        return self._entries[sample_id].record

    def evolved(self) -> list[str]:
        """The ids of the samples that have a version beyond the original, in the pool's order."""
        return [sid for sid in self.order if len(self._entries[sid].versions) > 1]

    def record(self, index: int) -> Record:
        """The record of the ``index``-th sample at its current version (what the dataloader serves)."""
        entry = self._entries[self.order[index]]
        cur = entry.current
        rec = copy.copy(entry.record)
        rec.image_path = Path(cur.image_path)
        rec.boxes = [list(b) for b in cur.boxes]
        if cur.query is not None:
            rec.query = cur.query
        rec.meta = {
            **entry.record.meta,
            **(cur.scene or {}),
            "version": cur.version,
            "level": cur.level,
            "original_image": str(entry.record.image_path),
        }
        if cur.scene is not None:  # what instruction evolution edits from: every level is an edit of the original
            rec.meta["original_meta"] = entry.record.meta
        return rec

    def swap(
        self,
        sample_id: str,
        image_path: str,
        boxes: list[list[float]],
        *,
        epoch: int,
        description: str | None,
        job_id: str | None,
        parent: int | None = None,
        query: str | None = None,
        level: int | None = None,
        scene: dict[str, Any] | None = None,
    ) -> Version:
        """Make ``image_path`` the current version of ``sample_id`` (with question ``query`` if given, else the current
        one, and ``scene``: what a visual edit made the image show); returns the new version."""
        if sample_id not in self._entries:
            raise KeyError(f"swap for unknown sample {sample_id!r}")
        entry = self._entries[sample_id]
        if job_id is not None and any(v.job_id == job_id for v in entry.versions):
            return next(v for v in entry.versions if v.job_id == job_id)  # idempotent: a resumed job swaps once
        v = Version(
            len(entry.versions),
            str(image_path),
            [list(b) for b in boxes],
            epoch=epoch,
            description=description,
            parent=entry.current.version if parent is None else parent,
            job_id=job_id,
            query=entry.current.query if query is None else query,
            level=entry.current.level if level is None else level,
            scene=scene,
        )
        entry.versions.append(v)
        return v

    def edit_question(
        self, sample_id: str, query: str, *, epoch: int, level: int = 0, base: str = "current"
    ) -> Version:
        """A new version of ``sample_id`` that asks ``query`` about its ``base`` image: the ``current`` one, or the
        ``original`` (instruction evolution edits the original scene's question, so a visual edit made earlier is
        undone). The caller guarantees that the base's boxes answer ``query``."""
        if sample_id not in self._entries:
            raise KeyError(f"question edit for unknown sample {sample_id!r}")
        if base not in ("current", "original"):
            raise ValueError(f"a question edit's base is 'current' or 'original', got {base!r}")
        entry = self._entries[sample_id]
        src = entry.current if base == "current" else entry.versions[0]
        return self.swap(
            sample_id,
            src.image_path,
            src.boxes,
            epoch=epoch,
            description=None,
            job_id=None,
            query=query,
            level=level,
            scene=src.scene,
        )

    def num_swapped(self) -> int:
        return sum(len(e.versions) > 1 for e in self._entries.values())

    def state_dict(self) -> dict[str, Any]:
        """Lineage of every sample (plain types): enough to rebuild the pool over the same base records."""
        return {"lineage": {sid: [asdict(v) for v in e.versions[1:]] for sid, e in self._entries.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for sid, versions in state.get("lineage", {}).items():
            if sid not in self._entries:
                raise DataError(
                    f"checkpoint pool holds sample {sid!r} that the configured training data lacks; "
                    "resume with the same --data.train_files"
                )
            entry = self._entries[sid]
            entry.versions = entry.versions[:1] + [Version(**v) for v in versions]


class PoolDataset(Dataset):
    """Reads each sample's *current* version at access time."""

    def __init__(self, pool: DataPool, max_pixels: int | None = None):
        self.pool = pool
        self.max_pixels = max_pixels

    def __len__(self) -> int:
        return len(self.pool)

    def __getitem__(self, i: int):
        return load_sample(self.pool.record(i), self.max_pixels)


class SyntheticDataModule(RECDataModule):
    """``RECDataModule`` whose training set is a ``DataPool`` that the ``SynthesisCallback`` evolves.

    Takes every argument of ``RECDataModule``; ``resumable`` defaults to True here, so a run resumed from a mid-epoch
    checkpoint trains on exactly the samples of an uninterrupted one (``datamodules.resumable``). Set
    ``trainer.reload_dataloaders_every_n_epochs: 1`` when ``num_workers > 0`` so worker processes see the swapped
    images (with ``num_workers: 0`` the pool is read live).
    """

    def __init__(self, *args, resumable: bool = True, **kwargs):
        super().__init__(*args, resumable=resumable, **kwargs)
        self.pool: DataPool | None = None
        self._pending_state: dict[str, Any] | None = None

    def setup(self, stage: str | None = None) -> None:
        if self.toy is not None and self.toy.render_train:
            raise DataError(
                "--data.toy.render_train is for SFT runs: the synthetic pool keeps image files and "
                "swaps them, so export the train split (set render_train: false)"
            )
        super().setup(stage)
        if self.pool is None and self.train_set is not None:
            self.pool = DataPool(self.train_set.records)
            if self._pending_state is not None:
                self.pool.load_state_dict(self._pending_state)
                self._pending_state = None

    def train_dataloader(self):
        if self.pool is None:
            raise DataError("no training data: set --data.train_files (or --data.toy for the toy world)")
        if self.resumable:
            return self._resumable_loader(
                PoolDataset(self.pool, self.max_pixels), collate_samples, persistent_workers=False
            )
        return DataLoader(
            PoolDataset(self.pool, self.max_pixels),
            batch_size=self.batch_size,
            shuffle=self.shuffle,
            num_workers=self.num_workers,
            collate_fn=collate_samples,
        )

    def state_dict(self) -> dict[str, Any]:
        return {"pool": self.pool.state_dict()} if self.pool is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "pool" not in state:
            return
        if self.pool is None:
            self._pending_state = state["pool"]
        else:
            self.pool.load_state_dict(state["pool"])
