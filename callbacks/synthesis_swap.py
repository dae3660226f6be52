"""The swap at an epoch boundary, for ``SynthesisCallback``: what finished (a painted or edited image, a question
edit) becomes a sample's new version in the ``DataPool``, on every rank alike (global zero broadcasts the list), and
the lineage gallery draws what the swaps made.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L

from callbacks.gallery import lineage_strip
from datamodules.synthetic import DataPool

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImageSwap:
    """A finished job's image (and, for a visual edit, its question, level and scene) for one sample."""

    sample_id: str
    image_path: str
    boxes: list[list[float]]
    description: str | None
    job_id: str
    parent: int
    query: str | None = None
    level: int | None = None
    scene: dict[str, Any] | None = None


@dataclass(frozen=True)
class QuestionEdit:
    """A new question about a sample's ``base`` image (``current`` or ``original``): no server involved."""

    sample_id: str
    query: str
    level: int
    base: str = "current"


def apply_swaps(pool: DataPool, swaps: list[ImageSwap | QuestionEdit], epoch: int) -> None:
    """Make each swap the sample's current version, first trained on in epoch ``epoch + 1``."""
    for s in swaps:
        if isinstance(s, QuestionEdit):
            pool.edit_question(s.sample_id, s.query, epoch=epoch + 1, level=s.level, base=s.base)
            continue
        pool.swap(
            s.sample_id,
            s.image_path,
            s.boxes,
            epoch=epoch + 1,
            description=s.description,
            job_id=s.job_id,
            parent=s.parent,
            query=s.query,
            level=s.level,
            scene=s.scene,
        )


class LineageGallery:
    """One strip per evolved sample (original -> each version, captioned), written to ``out_dir`` (default
    ``<default_root_dir>/lineage``) and sent to the loggers that take images, for the first ``samples`` samples."""

    def __init__(self, samples: int, out_dir: str | None):
        self.samples, self.out_dir = samples, out_dir

    def write(self, trainer: L.Trainer, pool: DataPool) -> None:
        if self.samples <= 0:
            return
        evolved = pool.evolved()
        if not evolved:
            return
        out_dir = Path(self.out_dir) if self.out_dir else Path(trainer.default_root_dir) / "lineage"
        out_dir.mkdir(parents=True, exist_ok=True)
        images = []
        max_epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None
        for sid in evolved[: self.samples]:
            strip = lineage_strip(pool.lineage(sid), query=pool.base_record(sid).query, max_epochs=max_epochs)
            strip.save(out_dir / f"{sid}.png")  # one strip per sample, the whole lineage (rewritten at each swap)
            images.append(strip)
        for logger in trainer.loggers:
            if hasattr(logger, "log_image"):
                try:
                    logger.log_image(key="synth/lineage", images=images, step=trainer.global_step)
                except Exception as err:  # a logger's image support must never stop training
                    log.warning("could not log the lineage gallery to %s: %s", type(logger).__name__, err)
