"""Record types every layer shares: one grounding sample (``Sample``) and the error a data file's defect raises
(``DataError``), and the strict JSONL reader that raises it (``jsonl_objects``). The data modules make them, the
training side reads them; they import nothing of the project."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from PIL import Image


class DataError(ValueError):
    """A defect in a data file; the message names the file and line and says what to fix."""


def jsonl_objects(path: str | Path) -> Iterator[tuple[Any, str]]:
    """``(object, "<file>:<line>")`` for every non-blank line of a JSONL file (a UTF-8 BOM allowed); a line that is not
    UTF-8 or not JSON raises `DataError` naming the file and line."""
    path = Path(path)
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


@dataclass
class Sample:
    """One grounding example. ``boxes`` are ``[x1, y1, x2, y2]`` in original pixels (REC: exactly one, or none for a
    no-target query, whose answer is ``no target``)."""

    sample_id: str
    image: Image.Image
    query: str
    boxes: list[list[float]]
    task: str = "rec"
    image_path: str | None = None
    source: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def size(self) -> tuple[int, int]:
        return self.image.size
