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
enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}." (:func:`answer_prompt`).
"""

from __future__ import annotations

import io
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image
from torch.utils.data import Dataset

from core.records import DataError

__all__ = [
    "ANSWER_FORMAT",
    "ReasoningDataset",
    "ReasoningRecord",
    "ReasoningSample",
    "answer_prompt",
    "load_reasoning_sample",
    "read_rows",
    "write_jsonl",
]

ANSWER_FORMAT = (
    "You FIRST think about the reasoning process as an internal monologue and then provide the final answer. "
    "The reasoning process MUST BE enclosed within <think> </think> tags. The final answer MUST BE put in \\boxed{}."
)
"""The seed's format instruction for the answer model (appended to the problem)."""


def answer_prompt(problem: str) -> str:
    """The answer model's user text: the problem (``<image>`` placeholders removed, stripped), a space, and
    :data:`ANSWER_FORMAT`."""
    return f"{problem.replace('<image>', '').strip()} {ANSWER_FORMAT}"


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


def _jsonl_objects(path: Path):
    with path.open("rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8").rstrip("\r\n")
            except UnicodeDecodeError:
                raise DataError(f"{where}: not UTF-8; re-encode the file as UTF-8") from None
            if lineno == 1:
                line = line.removeprefix("\ufeff")
            if not line.strip():
                continue
            try:
                yield json.loads(line), where
            except json.JSONDecodeError as err:
                raise DataError(f"{where}: not valid JSON ({err.msg} at column {err.pos + 1})") from None


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


_READERS = {".jsonl": _jsonl_objects, ".json": _json_objects, ".parquet": _parquet_objects}


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
