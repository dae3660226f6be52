"""Record types every layer shares: one grounding sample (``Sample``) and the error a data file's defect raises
(``DataError``). The data modules make them, the training side reads them; they import nothing of the project."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from PIL import Image


class DataError(ValueError):
    """A defect in a data file; the message names the file and line and says what to fix."""


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
