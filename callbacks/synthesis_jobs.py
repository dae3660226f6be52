"""The job flow of ``SynthesisCallback``: the strategy's evolution requests become data-server jobs (a repaint of a
sample's background, or a visual edit of its original image) and question edits; jobs are sent, followed until they
finish, and turned into swaps at the epoch boundary (``callbacks/synthesis_swap.py``).

A job's id, seed and canvas come from the sample, the epoch and the description alone, so a job resubmitted after a
server restart or a resume is the same request (the server answers it idempotently).
"""

from __future__ import annotations

import json
import logging
import random
import re
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from PIL import Image
from pydantic import ValidationError

from callbacks.evolution import EvolutionRequest
from callbacks.synthesis_swap import ImageSwap, QuestionEdit
from core.toy.scene import guard_description
from datamodules.synthetic import DataPool
from synth.api import MAX_DESCRIPTION_CHARS, ImageRef, JobRequest, VisualEdit
from synth.client import AsyncSubmitter

log = logging.getLogger(__name__)


@dataclass
class Outstanding:
    """A submitted job the pool has not swapped in yet."""

    job_id: str
    sample_id: str
    description: str
    epoch: int
    parent: int
    image_path: str
    boxes: list[list[float]]
    seed: int
    submitted_at: float
    extend: float = 0.0
    """Extra canvas as a fraction of the image's size (0: none)."""
    offset: tuple[int, int] | None = None
    """Top-left of the image on the extended canvas (None: centred)."""
    edit: dict[str, Any] | None = None
    """A visual edit job (``synth.api.VisualEdit`` as a dict) instead of a repaint."""
    query: str | None = None
    """The question the edited version asks (None: keep the current one)."""
    level: int | None = None
    """The edited version's difficulty level (instruction evolution)."""


def job_id(sample_id: str, epoch: int, description: str = "") -> str:
    """``<sample>@e<epoch>-<crc of the description>``: idempotent for a resubmitted job, and a batch replayed after
    a mid-epoch resume (same sample and epoch, a new description) gets a new id instead of a 409."""
    safe = re.sub(r"[^A-Za-z0-9._:+=-]", "-", sample_id)[:100] or "s"
    if not safe[0].isalnum():
        safe = "s" + safe
    return f"{safe}@e{epoch}-{zlib.crc32(description.encode()):08x}"


def guard_toy_description(description: str, meta: dict[str, Any]) -> str:
    """A toy-world description rewritten so that it paints no second copy of the referred object (which would make
    the query ambiguous and the box label wrong); any other sample's description as it is."""
    if not meta.get("objects"):
        return description
    return guard_description(description, meta)


class CanvasDraw:
    """Each job's canvas extension factor, drawn from ``extend`` (a factor or a ``[low, high]`` range), and with
    ``placement: random`` the image's position on the larger canvas, both seeded by the job id."""

    def __init__(self, extend: float | list[float], placement: str):
        lo, hi = (float(extend), float(extend)) if isinstance(extend, int | float) else tuple(map(float, extend))
        if not 0.0 <= lo <= hi <= 4.0:
            raise ValueError(
                f"SynthesisCallback extend must be a factor or a [low, high] range in [0, 4], got {extend!r}"
            )
        if placement not in ("center", "random"):
            raise ValueError(f"SynthesisCallback placement must be 'center' or 'random', got {placement!r}")
        self.extend_range, self.placement = (lo, hi), placement

    def draw(self, job_id: str, image_path: str) -> tuple[float, tuple[int, int] | None]:
        """The job's extension factor and placement, drawn from its own seed (the same after a resume)."""
        lo, hi = self.extend_range
        if hi <= 0:
            return 0.0, None
        rng = random.Random(zlib.crc32(b"canvas:" + job_id.encode()))
        f = round(rng.uniform(lo, hi), 4)
        if self.placement == "center" or f <= 0:
            return f, None
        with Image.open(image_path) as im:  # the header only
            w, h = im.size
        # the server's canvas for `extend`: the image grown by f of its size (rounded as synth.compose does)
        cw, ch = w + round(w * f), h + round(h * f)
        return f, (rng.randint(0, max(cw - w, 0)), rng.randint(0, max(ch - h, 0)))

    @staticmethod
    def request(job: Outstanding) -> dict[str, Any]:
        """The job's ``JobRequest.canvas``."""
        if job.extend <= 0:
            return {}
        canvas: dict[str, Any] = {"extend": job.extend}
        if job.offset is not None:
            canvas.update(offset_x=job.offset[0], offset_y=job.offset[1])
        return canvas


class JobFlow:
    """The jobs not swapped in yet (``outstanding``) and the question edits waiting for the boundary: made from the
    strategy's requests, sent, collected when they finish.

    Args: ``source``, ``unfinished`` and ``guard`` (``guard_toy_descriptions``) as ``SynthesisCallback``'s; ``canvas``
    draws each repaint's canvas.
    """

    def __init__(self, source: str, unfinished: str, guard: bool, canvas: CanvasDraw):
        if source not in ("original", "current"):
            raise ValueError(f"SynthesisCallback source must be 'original' or 'current', got {source!r}")
        if unfinished not in ("keep", "drop"):
            raise ValueError(f"SynthesisCallback unfinished must be 'keep' or 'drop', got {unfinished!r}")
        self.source, self.unfinished, self.guard, self.canvas = source, unfinished, guard, canvas
        self.outstanding: dict[str, Outstanding] = {}
        self.pending_edits: dict[str, dict[str, Any]] = {}
        """Question edits (instruction evolution) waiting for the epoch boundary, by sample id."""
        self.counts = {"submitted": 0, "swapped": 0, "failed": 0, "dropped": 0}

    def plan(self, requests: list[EvolutionRequest], epoch: int, pool: DataPool) -> list[Outstanding]:
        """Record this batch's requests: the new jobs (returned in order, to be sent) and question edits. One repaint
        per sample per epoch; the newest version asked for a sample replaces its older requests."""
        busy = {j.sample_id for j in self.outstanding.values() if j.epoch == epoch}
        made: list[Outstanding] = []
        for req in requests:
            sample_id, description = req.sample_id, req.description
            if req.query is not None or req.edits:
                self.pending_edits.pop(sample_id, None)
                for old in [j for j in self.outstanding.values() if j.sample_id == sample_id]:
                    self.outstanding.pop(old.job_id)
            if req.edits:
                made.append(self._add(self._edit_job(req, epoch, pool)))
                continue
            if req.query is not None:  # a question edit: applied at the epoch boundary, no server involved
                self.pending_edits[sample_id] = {
                    "query": req.query,
                    "level": req.level,
                    "epoch": epoch,
                    "base": req.base,
                }
            if not description or sample_id in busy:
                continue
            src = pool.original(sample_id) if self.source == "original" else pool.current(sample_id)
            if self.guard:
                description = guard_toy_description(description, pool.base_record(sample_id).meta)
            if len(description) > MAX_DESCRIPTION_CHARS:  # the API's limit; the painter reads the start anyway
                log.warning(
                    "description of %s cut from %d to %d characters", sample_id, len(description), MAX_DESCRIPTION_CHARS
                )
                description = description[:MAX_DESCRIPTION_CHARS]
            jid = job_id(sample_id, epoch, description)
            busy.add(sample_id)
            extend, offset = self.canvas.draw(jid, src.image_path)
            job = Outstanding(
                job_id=jid,
                sample_id=sample_id,
                description=description,
                epoch=epoch,
                parent=src.version,
                image_path=str(Path(src.image_path).resolve()),
                boxes=[list(b) for b in src.boxes],
                seed=zlib.crc32(jid.encode()) % (2**31),
                submitted_at=time.time(),
                extend=extend,
                offset=offset,
            )
            made.append(self._add(job))
        return made

    def _add(self, job: Outstanding) -> Outstanding:
        self.outstanding[job.job_id] = job
        self.counts["submitted"] += 1
        return job

    def _edit_job(self, req: EvolutionRequest, epoch: int, pool: DataPool) -> Outstanding:
        """A visual edit of the sample's original image and scene (instruction evolution edits the original)."""
        src = pool.original(req.sample_id)
        scene = pool.base_record(req.sample_id).meta
        if not (scene or {}).get("objects"):  # a real image (inpaint): no toy scene describes it
            scene = None
        jid = job_id(req.sample_id, epoch, json.dumps([list(req.edits), req.query, req.level], sort_keys=True))
        return Outstanding(
            job_id=jid,
            sample_id=req.sample_id,
            description="",
            epoch=epoch,
            parent=pool.current(req.sample_id).version,
            image_path=str(Path(src.image_path).resolve()),
            boxes=[list(b) for b in src.boxes],
            seed=zlib.crc32(jid.encode()) % (2**31),
            submitted_at=time.time(),
            edit={"steps": list(req.edits), "scene": scene},
            query=req.query,
            level=req.level,
        )

    def send(self, job: Outstanding, submitter: AsyncSubmitter) -> None:
        """Queue the job; a request the API cannot express is logged and counted as failed, never raised: it runs
        inside ``on_train_batch_end`` and must not stop training (the sample keeps its image)."""
        try:
            request = JobRequest(
                job_id=job.job_id,
                sample_id=job.sample_id,
                image=ImageRef(path=job.image_path),
                boxes=job.boxes,
                description=job.description,
                seed=job.seed,
                canvas=self.canvas.request(job),
                edit=None if job.edit is None else VisualEdit(**job.edit),
            )
        except ValidationError as err:
            log.warning("synthesis job %s not submitted (the sample keeps its image): %s", job.job_id, err)
            self.outstanding.pop(job.job_id, None)
            self.counts["failed"] += 1
            return
        submitter.submit(request)

    def collect(self, submitter: AsyncSubmitter, wait_s: float | None) -> tuple[list[ImageSwap], dict[str, Any]]:
        """The finished jobs' swaps (failed ones logged: their samples keep their images) and the epoch's figures;
        ``wait_s``: wait that long for every outstanding job first (``sync`` modes), None not at all."""
        if wait_s is not None and self.outstanding:
            try:
                submitter.wait(list(self.outstanding), timeout=wait_s)
            except TimeoutError as err:
                log.warning("sync synthesis: %s", err)
        now = time.time()
        swaps, lags, failed = [], [], 0
        finished = submitter.pop_finished()
        for status in finished:
            job = self.outstanding.pop(status.job_id, None)
            if job is None:
                continue
            res = status.result
            if status.state.value == "done" and res is not None and res.audit.passed:
                swaps.append(
                    ImageSwap(
                        sample_id=job.sample_id,
                        image_path=res.output_path,
                        boxes=res.boxes,
                        description=job.description or None,
                        job_id=job.job_id,
                        parent=job.parent,
                        query=job.query,
                        level=job.level,
                        scene=res.scene,
                    )
                )
                lags.append(now - job.submitted_at)
            else:
                failed += 1
                log.warning(
                    "synthesis job %s failed (the sample keeps its image): %s",
                    status.job_id,
                    status.error or (res.audit.message if res else "no result"),
                )
        submitter.ack([s.job_id for s in finished])
        dropped = 0
        if self.unfinished == "drop":
            dropped = len(self.outstanding)
            self.outstanding.clear()
        self.counts["swapped"] += len(swaps)
        self.counts["failed"] += failed
        self.counts["dropped"] += dropped
        stats = submitter.stats()
        return swaps, {
            "swaps": len(swaps),
            "failures": failed,
            "dropped": dropped,
            "outstanding": len(self.outstanding),
            "lag_s": sum(lags) / len(lags) if lags else 0.0,
            "queue_depth": stats["unsent"] + stats["in_flight"],
        }

    def take_question_edits(self) -> list[QuestionEdit]:
        """The question edits waiting for this boundary (a checkpoint of an older version may lack ``base``)."""
        edits = [
            QuestionEdit(sid, e["query"], e["level"], e.get("base", "current")) for sid, e in self.pending_edits.items()
        ]
        self.pending_edits = {}
        return edits

    def state_dict(self) -> dict[str, Any]:
        return {
            "outstanding": {k: asdict(v) for k, v in self.outstanding.items()},
            "pending_edits": dict(self.pending_edits),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.outstanding = {k: Outstanding(**v) for k, v in state.get("outstanding", {}).items()}
        self.pending_edits = dict(state.get("pending_edits", {}))
