"""Reasoning rows (MMK12-style visual math) and the answer model's prompt.

A row, in a JSON list, a JSONL file (one object a line) or a parquet table::

    {"id": "mmk12-17", "image": "images/17.png", "problem": "In the figure, AB = 3 ...", "answer": "\\frac{3}{2}"}

One image a row: a path relative to the file's folder (or ``image_root``), a one-element list of it, or, in parquet,
the embedded bytes (``{"bytes": ..., "path": ...}`` as Hugging Face datasets write images, or raw bytes). ``answer``
may be a number (kept as its text). Other keys are kept in ``meta`` (the toy world stores its scene there). Every
defect (bad JSON, a missing or empty key, two images, a duplicate id, a missing or unreadable image) raises
``DataError`` naming the file and the line (JSONL) or row (JSON, parquet).

The answer model's prompt is the seed's (EasyR1's math format prompt): the problem, then "You FIRST think about the
reasoning process as an internal monologue and then provide the final answer. The reasoning process MUST BE
enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}." (``core.math_prompts.answer_prompt``,
which the methods that ask the answer model use too).
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from core.math_prompts import answer_prompt
from core.records import DataError, jsonl_objects
from datamodules.resumable import EpochSampler, ResumableLoader
from datamodules.toy_math import ToyMathSpec

__all__ = [
    "ReasoningDataModule",
    "ReasoningDataset",
    "ReasoningRecord",
    "ReasoningSample",
    "collate_reasoning",
    "load_reasoning_sample",
    "read_rows",
    "write_jsonl",
]


@dataclass
class ReasoningRecord:
    """A parsed row before its image is opened."""

    sample_id: str
    problem: str
    answer: str
    image_path: Path | None
    """The image file (None when the row embeds its bytes)."""
    image_bytes: bytes | None
    source: str
    """``file:line`` or ``file[row i]``, for error messages."""
    meta: dict[str, Any] = field(default_factory=dict)


@dataclass
class ReasoningSample:
    """One reasoning example with its image loaded."""

    sample_id: str
    image: Image.Image
    problem: str
    answer: str
    image_path: str | None = None
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def prompt(self) -> str:
        return answer_prompt(self.problem)


_KEYS = ("id", "image", "problem", "answer")


def _text_field(obj: dict, key: str, where: str) -> str:
    value = obj.get(key)
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):  # numpy scalars from parquet
        value = value.item()
    if isinstance(value, bool) or value is None:
        raise DataError(f"{where}: missing '{key}' (a row needs {', '.join(_KEYS)})")
    if isinstance(value, int) or (isinstance(value, float) and math.isfinite(value)):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise DataError(f"{where}: '{key}' must be a non-empty string, got {value!r}")
    return value.strip()


def _image_of(value: Any, root: Path, where: str) -> tuple[Path | None, bytes | None]:
    if isinstance(value, (list, tuple)) or (hasattr(value, "tolist") and not isinstance(value, (bytes, dict))):
        items = list(value.tolist() if hasattr(value, "tolist") else value)
        if len(items) != 1:
            raise DataError(f"{where}: one image a row, got {len(items)} in 'image'")
        value = items[0]
    if isinstance(value, dict):  # Hugging Face datasets' Image feature: {"bytes": ..., "path": ...}
        if isinstance(value.get("bytes"), (bytes, bytearray)) and value["bytes"]:
            return None, bytes(value["bytes"])
        value = value.get("path")
    if isinstance(value, (bytes, bytearray)) and value:
        return None, bytes(value)
    if isinstance(value, str) and value.strip():
        path = Path(value.strip())
        return (path if path.is_absolute() else root / path), None
    raise DataError(f"{where}: missing 'image' (a path relative to {root}, or the image's bytes in parquet)")


def _record(obj: Any, where: str, root: Path) -> ReasoningRecord:
    if not isinstance(obj, dict):
        raise DataError(f"{where}: expected an object with keys {', '.join(_KEYS)}, got {type(obj).__name__}")
    image_path, image_bytes = _image_of(obj.get("image"), root, where)
    meta = {k: v for k, v in obj.items() if k not in _KEYS}
    if isinstance(meta.get("meta"), dict):
        meta = {**{k: v for k, v in meta.items() if k != "meta"}, **meta["meta"]}
    return ReasoningRecord(
        sample_id=_text_field(obj, "id", where),
        problem=_text_field(obj, "problem", where),
        answer=_text_field(obj, "answer", where),
        image_path=image_path,
        image_bytes=image_bytes,
        source=where,
        meta=meta,
    )


def _json_objects(path: Path):
    try:
        data = json.loads(path.read_text(encoding="utf-8-sig"))
    except UnicodeDecodeError:
        raise DataError(f"{path}: not UTF-8; re-encode the file as UTF-8") from None
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: not valid JSON ({err.msg} at column {err.colno})") from None
    if isinstance(data, dict) and isinstance(data.get("data"), list):
        data = data["data"]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON list of rows (or {{'data': [...]}}), got {type(data).__name__}")
    for i, obj in enumerate(data):
        yield obj, f"{path}[row {i}]"


def _parquet_objects(path: Path):
    try:
        import pandas as pd

        frame = pd.read_parquet(path)
    except ImportError as err:
        raise DataError(f"{path}: reading parquet needs pyarrow ({err}); pip install pyarrow") from None
    except Exception as err:  # noqa: BLE001 - pyarrow raises many types for a broken file
        raise DataError(f"{path}: not a readable parquet file ({type(err).__name__}: {err})") from None
    missing = [k for k in _KEYS if k not in frame.columns]
    if missing:
        raise DataError(f"{path}: parquet columns {missing} missing (have {list(frame.columns)})")
    for i, obj in enumerate(frame.to_dict(orient="records")):
        yield obj, f"{path}[row {i}]"


_READERS = {".jsonl": jsonl_objects, ".json": _json_objects, ".parquet": _parquet_objects}


def read_rows(
    path: str | Path, image_root: str | Path | None = None, max_samples: int | None = None
) -> list[ReasoningRecord]:
    """Parse a ``.json`` / ``.jsonl`` / ``.parquet`` file of ``{id, image, problem, answer}`` rows (images are not
    opened here; image paths are relative to ``image_root``, by default the file's folder)."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    reader = _READERS.get(path.suffix.lower())
    if reader is None:
        raise DataError(f"{path}: unknown format {path.suffix!r}; use .json, .jsonl or .parquet")
    root = Path(image_root) if image_root is not None else path.parent
    records: list[ReasoningRecord] = []
    seen: dict[str, str] = {}
    for obj, where in reader(path):
        rec = _record(obj, where, root)
        if rec.sample_id in seen:
            raise DataError(f"{where}: duplicate id {rec.sample_id!r} (first at {seen[rec.sample_id]})")
        seen[rec.sample_id] = where
        records.append(rec)
        if max_samples is not None and len(records) >= max_samples:
            break
    if not records:
        raise DataError(f"{path}: no rows in the file")
    return records


def load_reasoning_sample(rec: ReasoningRecord) -> ReasoningSample:
    """Open the record's image (file or embedded bytes) as RGB."""
    try:
        if rec.image_bytes is not None:
            with Image.open(io.BytesIO(rec.image_bytes)) as im:
                image = im.convert("RGB")
        else:
            if rec.image_path is None or not rec.image_path.is_file():
                raise DataError(f"{rec.source}: image {rec.image_path} not found; set image_root to its folder")
            with Image.open(rec.image_path) as im:
                image = im.convert("RGB")
    except DataError:
        raise
    except Exception as err:  # noqa: BLE001 - PIL raises many types for a broken image
        raise DataError(f"{rec.source}: the image cannot be read ({type(err).__name__}: {err})") from None
    return ReasoningSample(
        sample_id=rec.sample_id,
        image=image,
        problem=rec.problem,
        answer=rec.answer,
        image_path=None if rec.image_path is None else str(rec.image_path),
        source=rec.source,
        meta=dict(rec.meta),
    )


class ReasoningDataset(Dataset):
    """Reasoning records; images load on access."""

    def __init__(self, records: list[ReasoningRecord]):
        self.records = list(records)

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, i: int) -> ReasoningSample:
        return load_reasoning_sample(self.records[i])


def write_jsonl(path: str | Path, rows: list[dict[str, Any]]) -> Path:
    """Write rows as JSONL (UTF-8, one object a line, keys ``id, image, problem, answer`` first), atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    lines = []
    for row in rows:
        ordered = {k: row[k] for k in _KEYS if k in row} | {k: v for k, v in row.items() if k not in _KEYS}
        lines.append(json.dumps(ordered, ensure_ascii=False) + "\n")
    tmp.write_text("".join(lines), encoding="utf-8")
    tmp.replace(path)
    return path


def collate_reasoning(batch: list[ReasoningSample]) -> list[ReasoningSample]:
    """Keep PIL images and texts as they are: the processor does the tensor work at rollout time."""
    return list(batch)


class ReasoningDataModule(L.LightningDataModule):
    """Reasoning rows: a train set and named validation / test sets (one metric prefix each).

    Args:
        data_root: folder the file names below are relative to.
        train_files: files read as one training set (ids must not repeat across them).
        val_files: name -> file, e.g. ``{toy_math_val: val.jsonl, mmk12_test: test.parquet}``.
        test_files: as ``val_files``, for ``train.py test``.
        image_root: where image paths are relative to (default: each file's folder).
        batch_size: prompts per training step; eval_batch_size: per validation / test batch.
        max_train_samples / max_eval_samples: read at most this many rows of each file (the first ones).
        toy: generate the toy visual-math world into ``data_root`` first (the embedded default); with no files
            given, ``train.jsonl`` trains and every other split validates.
    """

    def __init__(
        self,
        data_root: str = "data/toy_math",
        train_files: list[str] | None = None,
        val_files: dict[str, str] | None = None,
        test_files: dict[str, str] | None = None,
        image_root: str | None = None,
        batch_size: int = 8,
        eval_batch_size: int = 8,
        max_train_samples: int | None = None,
        max_eval_samples: int | None = None,
        num_workers: int = 0,
        shuffle: bool = True,
        seed: int = 0,
        toy: ToyMathSpec | None = None,
    ):
        super().__init__()
        self.data_root = Path(data_root)
        self.toy = toy
        if toy is not None and not train_files and not val_files:
            train_files = ["train.jsonl"] if "train" in toy.splits else []
            val_files = {f"toy_math_{s}": f"{s}.jsonl" for s in toy.splits if s != "train"}
        self.train_files = list(train_files or [])
        self.val_files = dict(val_files or {})
        self.test_files = dict(test_files or {})
        self.image_root = image_root
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size
        self.max_train_samples, self.max_eval_samples = max_train_samples, max_eval_samples
        self.num_workers, self.shuffle, self.seed = num_workers, shuffle, seed
        self.train_set: ReasoningDataset | None = None
        self.eval_sets: dict[str, dict[str, ReasoningDataset]] = {"val": {}, "test": {}}

    def prepare_data(self) -> None:
        if self.toy is not None:
            self.toy.export(self.data_root)

    def _records(self, files: list[str], limit: int | None) -> list[ReasoningRecord]:
        records: list[ReasoningRecord] = []
        seen: dict[str, str] = {}
        for f in files:
            path = Path(f) if Path(f).is_absolute() else self.data_root / f
            for rec in read_rows(path, self.image_root, limit):
                if rec.sample_id in seen:
                    raise DataError(f"{rec.source}: id {rec.sample_id!r} also at {seen[rec.sample_id]}")
                seen[rec.sample_id] = rec.source
                records.append(rec)
        return records

    def setup(self, stage: str | None = None) -> None:
        if stage in (None, "fit") and self.train_set is None and self.train_files:
            self.train_set = ReasoningDataset(self._records(self.train_files, self.max_train_samples))
        for kind, files in (("val", self.val_files), ("test", self.test_files)):
            if stage is None or stage in {"val": ("fit", "validate"), "test": ("test", "predict")}[kind]:
                for name, f in files.items():
                    if name not in self.eval_sets[kind]:
                        self.eval_sets[kind][name] = ReasoningDataset(self._records([f], self.max_eval_samples))

    def train_dataloader(self):
        if self.train_set is None:
            raise DataError("no training data: set --data.train_files (or --data.toy for the toy math world)")

        # resumable mid-epoch (a killed round's fit resumes with the batches it had not trained on, not epoch 0's)
        trainer = self.trainer  # LightningDataModule's attribute; None outside a fit
        world, rank = (trainer.world_size, trainer.global_rank) if trainer is not None else (1, 0)
        sampler = EpochSampler(len(self.train_set), self.shuffle, self.seed, num_replicas=world, rank=rank)
        return ResumableLoader(self.train_set, batch_size=self.batch_size, sampler=sampler,
                               num_workers=self.num_workers, collate_fn=collate_reasoning)  # fmt: skip

    def _eval_loaders(self, kind: str):
        return [
            DataLoader(
                ds,
                batch_size=self.eval_batch_size,
                shuffle=False,
                num_workers=self.num_workers,
                collate_fn=collate_reasoning,
            )  # fmt: skip
            for ds in self.eval_sets[kind].values()
        ]

    def eval_names(self, kind: str) -> list[str]:
        return list(self.eval_sets[kind])

    def val_dataloader(self):
        return self._eval_loaders("val")

    def test_dataloader(self):
        return self._eval_loaders("test")

    def predict_dataloader(self):  # train.py predict answers the test sets (callbacks.predictions writes them)
        return self._eval_loaders("test")
