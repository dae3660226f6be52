"""SynthesisCallback: carries out a data-evolution strategy (``callbacks/evolution.py``): sends the descriptions it
chooses (Syn-GRPO: the policy's selected ones) to the data server and swaps finished images into the DataPool at
epoch boundaries (Syn-GRPO's self-evolving loop); question edits (instruction evolution) swap in at the same boundary.

Training never waits on HTTP in the default ``async`` mode: ``AsyncSubmitter`` posts and polls from a daemon thread,
and the callback only enqueues (after each batch) and drains (at each epoch end). ``sync`` blocks after every batch
until that batch's images are painted (the paper's Table 5 ablation: generation inside the training loop);
``sync_epoch`` waits once, at the epoch boundary, for every job of the epoch; ``off`` disables synthesis (plain GRPO
data). In every mode the images swap in at the epoch boundary.

Canvas extension (``extend``): the paper repaints "the background and the extended canvas". Each job draws an extension
factor from the configured range (seeded by its job id) and, with ``placement: random``, a position of the image on the
larger canvas, so the object's scale and position in the frame vary; the server maps the boxes exactly.

Failure semantics: a job that fails (painter error, failed foreground audit, rejected request) leaves the sample's
current image in place. If the server dies, training goes on with the current images; a local server is restarted
at the next epoch boundary and the outstanding jobs are resubmitted with the same ``job_id`` (idempotent), as they
are after a resume from a checkpoint (the callback's state holds them).
"""

from __future__ import annotations

import hashlib
import logging
import re
import time
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from callbacks.evolution import EvolutionRequest, build_strategy
from synth.api import MAX_DESCRIPTION_CHARS

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


def _job_id(sample_id: str, epoch: int, description: str = "") -> str:
    """``<sample>@e<epoch>-<crc of the description>``: idempotent for a resubmitted job, and a batch replayed after
    a mid-epoch resume (same sample and epoch, a new description) gets a new id instead of a 409."""
    safe = re.sub(r"[^A-Za-z0-9._:+=-]", "-", sample_id)[:100] or "s"
    if not safe[0].isalnum():
        safe = "s" + safe
    return f"{safe}@e{epoch}-{zlib.crc32(description.encode()):08x}"


class SynthesisCallback(Callback):
    """Submit selected descriptions, poll in the background, swap finished images in at each epoch end.

    Args:
        mode: ``async`` (default), ``sync`` (block after every batch until its images are painted: Table 5's
            ablation), ``sync_epoch`` (wait once at each epoch boundary) or ``off``.
        url: data server URL; ``None`` starts a local server subprocess with ``server_config``.
        token: bearer token for ``url`` (default: the ``token_env`` environment variable).
        token_env: environment variable holding the token.
        server_config: YAML of the local server (procedural painter by default).
        server_overrides: overrides of that YAML, e.g. ``{devices: [cuda:4]}`` so synthesis gets its own GPU.
        output_dir: where the local server writes images (default ``<default_root_dir>/synth``).
        source: repaint the ``original`` image (default) or the ``current`` version (chained evolution).
        unfinished: ``keep`` jobs not finished at an epoch end for a later swap, or ``drop`` them.
        strategy: which samples evolve and into what (``callbacks/evolution.py``): ``method`` (the training step's
            evolution requests: Syn-GRPO's selected descriptions), ``offline`` (a JSONL file) or ``random``.
        strategy_args: the strategy's settings (``offline``: ``path``; ``random``: ``seed``).
        offline_descriptions: JSONL of ``{"sample_id", "description"}`` ("GRPO + Offline Generation"): shorthand for
            ``strategy: offline`` with ``strategy_args: {path: ...}``.
        guard_toy_descriptions: rewrite a toy-world description that would paint a second copy of the referred
            object (which would make the query ambiguous and the box label wrong).
        poll_interval: seconds between the background thread's polls.
        sync_timeout: seconds a ``sync`` / ``sync_epoch`` wait may last.
        extend: canvas extension factor per job, a fixed value or a ``[low, high]`` range drawn per job (0: none;
            0.5: a canvas 1.5 x the image's width and height). Boxes are carried exactly by the server.
        placement: ``center`` or ``random`` (a uniformly drawn position of the image on the extended canvas).
        gallery_samples: lineages drawn in the gallery each epoch (0 disables).
        gallery_dir: where gallery PNGs go (default ``<default_root_dir>/lineage``).
        client_id: the client id this run presents to the data server (it sees only its own jobs there); default
            one derived from the run folder, the same after a resume (:meth:`client_identity`). With ``url``,
            ``token`` (or ``$token_env``) is the server's secret or this client's own token.
    """

    def __init__(
        self,
        mode: str = "async",
        url: str | None = None,
        token: str | None = None,
        token_env: str = "SYNTH_TOKEN",
        server_config: str = "configs/synth/procedural.yaml",
        server_overrides: dict[str, Any] | None = None,
        output_dir: str | None = None,
        source: str = "original",
        unfinished: str = "keep",
        offline_descriptions: str | None = None,
        strategy: str = "method",
        strategy_args: dict[str, Any] | None = None,
        guard_toy_descriptions: bool = True,
        poll_interval: float = 0.2,
        sync_timeout: float = 600.0,
        gallery_samples: int = 4,
        gallery_dir: str | None = None,
        extend: float | list[float] = 0.0,
        placement: str = "center",
        client_id: str | None = None,
    ):
        if mode not in ("async", "sync", "sync_epoch", "off"):
            raise ValueError(f"SynthesisCallback mode must be 'async', 'sync', 'sync_epoch' or 'off', got {mode!r}")
        lo, hi = (float(extend), float(extend)) if isinstance(extend, int | float) else tuple(map(float, extend))
        if not 0.0 <= lo <= hi <= 4.0:
            raise ValueError(
                f"SynthesisCallback extend must be a factor or a [low, high] range in [0, 4], got {extend!r}"
            )
        if placement not in ("center", "random"):
            raise ValueError(f"SynthesisCallback placement must be 'center' or 'random', got {placement!r}")
        self.extend_range, self.placement = (lo, hi), placement
        if source not in ("original", "current"):
            raise ValueError(f"SynthesisCallback source must be 'original' or 'current', got {source!r}")
        if unfinished not in ("keep", "drop"):
            raise ValueError(f"SynthesisCallback unfinished must be 'keep' or 'drop', got {unfinished!r}")
        self.mode, self.url, self.token, self.token_env = mode, url, token, token_env
        self.client_id = client_id
        self.server_config, self.output_dir, self.source, self.unfinished = (
            server_config,
            output_dir,
            source,
            unfinished,
        )
        self.guard = guard_toy_descriptions
        self.server_overrides = dict(server_overrides or {})
        self.poll_interval, self.sync_timeout = poll_interval, sync_timeout
        self.gallery_samples, self.gallery_dir = gallery_samples, gallery_dir
        strategy_args = dict(strategy_args or {})
        if offline_descriptions:
            if strategy not in ("method", "offline"):
                raise ValueError(
                    f"SynthesisCallback offline_descriptions is the 'offline' strategy; got strategy {strategy!r} too: "
                    "keep one of them"
                )
            strategy, strategy_args = "offline", {**strategy_args, "path": offline_descriptions}
        self.strategy = build_strategy(strategy, **strategy_args)
        self.outstanding: dict[str, Outstanding] = {}
        self.pending_edits: dict[str, dict[str, Any]] = {}
        """Question edits (instruction evolution) waiting for the epoch boundary, by sample id."""
        self.totals = {"submitted": 0, "swapped": 0, "failed": 0, "dropped": 0, "server_restarts": 0}
        self.history: list[dict[str, Any]] = []
        self.last_boundary = -1
        """The last epoch whose end swap was made (-1: none yet)."""
        self._server = None
        self._submitter = None
        self._pool = None
        self._restored = False

    # ------------------------------------------------------------------------------------------------ lifecycle
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if stage != "fit" or self.mode == "off":
            return
        dm = trainer.datamodule
        if dm is None or not hasattr(dm, "pool"):
            raise TypeError(
                "SynthesisCallback needs --data.class_path datamodules.synthetic.SyntheticDataModule "
                f"(got {type(dm).__name__}); or set the callback's mode: off"
            )

    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.mode == "off":
            return
        self._pool = trainer.datamodule.pool
        if trainer.is_global_zero and self.strategy.paints:
            self._connect(trainer)
            for job in list(self.outstanding.values()):  # restored from a checkpoint: resubmit idempotently
                self._submit(job)

    def _connect(self, trainer: L.Trainer) -> None:
        from synth.client import AsyncSubmitter, LocalServer, SynthClient

        if self.url is None:
            root = Path(trainer.default_root_dir)
            out = Path(self.output_dir) if self.output_dir else root / "synth"
            out.mkdir(parents=True, exist_ok=True)
            data_root = Path(trainer.datamodule.data_root)
            image_root = trainer.datamodule.image_root
            roots = sorted({str(p.resolve()) for p in (data_root, out, Path(image_root or data_root))})
            self._server = LocalServer(
                self.server_config,
                roots=roots,
                output_dir=out,
                overrides=self.server_overrides,
                log_path=root / "synth_server.log",
            )
            self._server.start()
            client = self._server.client(client_id=self.client_identity(trainer))
        else:
            import os

            token = self.token or os.environ.get(self.token_env)
            if not token:
                raise ValueError(
                    f"SynthesisCallback url={self.url!r} needs a token: set the {self.token_env} "
                    "environment variable or the callback's token"
                )
            client = SynthClient(self.url, token, client_id=self.client_identity(trainer))
        self._submitter = AsyncSubmitter(client, poll_interval=self.poll_interval)

    def client_identity(self, trainer: L.Trainer) -> str:
        """The client id this run presents to the data server: ``client_id`` if set, else one derived from the run
        folder (its name and a hash of its absolute path), so a resumed run is the same client and finds its jobs."""
        if self.client_id:
            return self.client_id
        root = Path(trainer.default_root_dir).resolve()
        slug = re.sub(r"[^A-Za-z0-9._-]+", "-", root.name).strip("-._")[:40] or "run"
        return f"run-{slug}-{hashlib.sha256(str(root).encode()).hexdigest()[:12]}"

    def _local_server_dead(self) -> bool:
        return self._server is not None and (self._server.proc is None or self._server.proc.poll() is not None)

    def _restart_local_server(self, trainer: L.Trainer) -> None:
        log.warning("synthesis server died; restarting it and resubmitting %d outstanding jobs", len(self.outstanding))
        self._close()
        self.totals["server_restarts"] += 1
        self._connect(trainer)
        for job in list(self.outstanding.values()):
            self._submit(job)

    def _close(self) -> None:
        if self._submitter is not None:
            self._submitter.close(timeout=5.0)
            self._submitter = None
        if self._server is not None:
            self._server.stop()
            self._server = None

    def on_fit_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._close()

    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        self._close()

    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self._close()

    # ------------------------------------------------------------------------------------------------ submit
    def _submit(self, job: Outstanding) -> None:
        """Queue the job; a request the API cannot express is logged and counted as failed, never raised: it runs
        inside ``on_train_batch_end`` and must not stop training (the sample keeps its image)."""
        from pydantic import ValidationError

        from synth.api import ImageRef, JobRequest, VisualEdit

        try:
            request = JobRequest(
                job_id=job.job_id,
                sample_id=job.sample_id,
                image=ImageRef(path=job.image_path),
                boxes=job.boxes,
                description=job.description,
                seed=job.seed,
                canvas=self._canvas(job),
                edit=None if job.edit is None else VisualEdit(**job.edit),
            )
        except ValidationError as err:
            log.warning("synthesis job %s not submitted (the sample keeps its image): %s", job.job_id, err)
            self.outstanding.pop(job.job_id, None)
            self.totals["failed"] += 1
            return
        self._submitter.submit(request)

    def _canvas(self, job: Outstanding) -> dict[str, Any]:
        if job.extend <= 0:
            return {}
        canvas: dict[str, Any] = {"extend": job.extend}
        if job.offset is not None:
            canvas.update(offset_x=job.offset[0], offset_y=job.offset[1])
        return canvas

    def _draw_canvas(self, job_id: str, image_path: str) -> tuple[float, tuple[int, int] | None]:
        """The job's extension factor and placement, drawn from its own seed (the same after a resume)."""
        import random

        lo, hi = self.extend_range
        if hi <= 0:
            return 0.0, None
        rng = random.Random(zlib.crc32(b"canvas:" + job_id.encode()))
        f = round(rng.uniform(lo, hi), 4)
        if self.placement == "center" or f <= 0:
            return f, None
        from PIL import Image

        with Image.open(image_path) as im:  # the header only
            w, h = im.size
        # the server's canvas for `extend`: the image grown by f of its size (rounded as synth.compose does)
        cw, ch = w + round(w * f), h + round(h * f)
        return f, (rng.randint(0, max(cw - w, 0)), rng.randint(0, max(ch - h, 0)))

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx):
        if self.mode == "off":
            return
        chosen: list[EvolutionRequest] = self.strategy.requests(trainer.current_epoch, batch, outputs)
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            gathered: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, chosen)
            chosen = [c for part in gathered for c in part]
        if not trainer.is_global_zero:
            return
        epoch = trainer.current_epoch
        busy = {j.sample_id for j in self.outstanding.values() if j.epoch == epoch}
        submitted: list[str] = []
        for req in chosen:
            sample_id, description = req.sample_id, req.description
            if req.query is not None or req.edits:  # the newest version asked for a sample replaces older requests
                self.pending_edits.pop(sample_id, None)
                for old in [j for j in self.outstanding.values() if j.sample_id == sample_id]:
                    self.outstanding.pop(old.job_id)
            if req.edits:
                job = self._edit_job(req, epoch)
                self.outstanding[job.job_id] = job
                self.totals["submitted"] += 1
                submitted.append(job.job_id)
                if self._submitter is not None:
                    self._submit(job)
                continue
            if req.query is not None:  # a question edit: applied at the epoch boundary, no server involved
                self.pending_edits[sample_id] = {
                    "query": req.query,
                    "level": req.level,
                    "epoch": epoch,
                    "base": req.base,
                }
            if not description or sample_id in busy:  # one job per sample per epoch
                continue
            src = self._pool.original(sample_id) if self.source == "original" else self._pool.current(sample_id)
            if self.guard:
                description = _guard(description, self._pool.entries[sample_id].record.meta)
            if len(description) > MAX_DESCRIPTION_CHARS:  # the API's limit; the painter reads the start anyway
                log.warning(
                    "description of %s cut from %d to %d characters", sample_id, len(description), MAX_DESCRIPTION_CHARS
                )
                description = description[:MAX_DESCRIPTION_CHARS]
            job_id = _job_id(sample_id, epoch, description)
            busy.add(sample_id)
            extend, offset = self._draw_canvas(job_id, src.image_path)
            job = Outstanding(
                job_id=job_id,
                sample_id=sample_id,
                description=description,
                epoch=epoch,
                parent=src.version,
                image_path=str(Path(src.image_path).resolve()),
                boxes=[list(b) for b in src.boxes],
                seed=zlib.crc32(job_id.encode()) % (2**31),
                submitted_at=time.time(),
                extend=extend,
                offset=offset,
            )
            self.outstanding[job_id] = job
            self.totals["submitted"] += 1
            submitted.append(job_id)
            if self._submitter is not None:
                self._submit(job)
        if self._submitter is None:
            return
        if self.mode == "sync" and submitted:  # the paper's synchronous ablation: this batch's images, now
            t0 = time.time()
            try:
                self._submitter.wait(submitted, timeout=self.sync_timeout)
            except TimeoutError as err:
                log.warning("sync synthesis: %s", err)
            pl_module.log(
                "synth/wait_s", time.time() - t0, batch_size=1, on_step=True, on_epoch=False, rank_zero_only=True
            )
        stats = self._submitter.stats()
        pl_module.log(
            "synth/queue_depth",
            float(stats["unsent"] + stats["in_flight"]),
            batch_size=1,
            on_step=True,
            on_epoch=False,
            rank_zero_only=True,
        )

    def _edit_job(self, req: EvolutionRequest, epoch: int) -> Outstanding:
        """A visual edit of the sample's original image and scene (instruction evolution edits the original)."""
        import json

        src = self._pool.original(req.sample_id)
        scene = self._pool.entries[req.sample_id].record.meta
        if not (scene or {}).get("objects"):  # a real image (inpaint): no toy scene describes it
            scene = None
        job_id = _job_id(req.sample_id, epoch, json.dumps([list(req.edits), req.query, req.level], sort_keys=True))
        return Outstanding(
            job_id=job_id,
            sample_id=req.sample_id,
            description="",
            epoch=epoch,
            parent=self._pool.current(req.sample_id).version,
            image_path=str(Path(src.image_path).resolve()),
            boxes=[list(b) for b in src.boxes],
            seed=zlib.crc32(job_id.encode()) % (2**31),
            submitted_at=time.time(),
            edit={"steps": list(req.edits), "scene": scene},
            query=req.query,
            level=req.level,
        )

    # ------------------------------------------------------------------------------------------------ swap
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.mode == "off":
            return
        self._boundary(trainer, pl_module, trainer.current_epoch, log_metrics=True)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # A run resumed from a checkpoint saved after the last batch of an epoch starts at the next epoch, and
        # Lightning does not run the finished epoch's end hooks: the swap at that boundary is made here instead, so
        # the next epoch trains on the images an uninterrupted run would have swapped in.
        if self.mode == "off":
            return
        for epoch in range(self.last_boundary + 1, trainer.current_epoch):
            log.info("synthesis: making the swap of epoch %d's end, which the resumed run skipped", epoch)
            self._boundary(trainer, pl_module, epoch, log_metrics=False)

    def _boundary(self, trainer: L.Trainer, pl_module: L.LightningModule, epoch: int, log_metrics: bool) -> None:
        """Collect the finished jobs and swap them in for epoch ``epoch + 1`` (all ranks)."""
        swaps: list[dict[str, Any]] = []
        report: dict[str, Any] = {}
        if trainer.is_global_zero:
            swaps, report = self._collect(trainer)
            if self.pending_edits:
                swaps += [{"sample_id": sid, **edit} for sid, edit in self.pending_edits.items()]
                report["question_edits"] = len(self.pending_edits)
                self.pending_edits = {}
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            box = [swaps]
            torch.distributed.broadcast_object_list(box, src=0)
            swaps = box[0]
        for s in swaps:
            if "image_path" not in s:  # a question edit: the base image, a new question
                self._pool.edit_question(
                    s["sample_id"], s["query"], epoch=epoch + 1, level=s["level"], base=s.get("base", "current")
                )
                continue
            self._pool.swap(
                s["sample_id"],
                s["image_path"],
                s["boxes"],
                epoch=epoch + 1,
                description=s["description"],
                job_id=s["job_id"],
                parent=s["parent"],
                query=s.get("query"),
                level=s.get("level"),
                scene=s.get("scene"),
            )
        self.last_boundary = epoch
        if trainer.is_global_zero:
            report.update(epoch=epoch, pool_swapped=self._pool.num_swapped(), pool_size=len(self._pool))
            self.history.append(report)
            if log_metrics:
                pl_module.log_dict(
                    {f"synth/{k}": float(v) for k, v in report.items() if isinstance(v, int | float) and k != "epoch"},
                    rank_zero_only=True,
                    on_step=False,
                    on_epoch=True,
                )
            self._write_gallery(trainer)

    def _collect(self, trainer: L.Trainer) -> tuple[list[dict[str, Any]], dict[str, Any]]:
        if not self.strategy.paints:  # question edits only: no server, no jobs
            return [], {"swaps": 0, **self.strategy.stats()}
        if self._local_server_dead() or self._submitter is None:
            try:
                self._restart_local_server(trainer)
            except Exception as err:  # training goes on with the current images; try again next epoch
                log.warning("synthesis server could not be restarted (%s); no swaps this epoch", err)
                self._submitter = None
                return [], {
                    "swaps": 0,
                    "failures": 0,
                    "dropped": 0,
                    "outstanding": len(self.outstanding),
                    "lag_s": 0.0,
                    "queue_depth": 0,
                    "server_restarts": self.totals["server_restarts"],
                }
        if self.mode in ("sync", "sync_epoch") and self.outstanding:
            try:
                self._submitter.wait(list(self.outstanding), timeout=self.sync_timeout)
            except TimeoutError as err:
                log.warning("sync synthesis: %s", err)
        now = time.time()
        swaps, lags, failed = [], [], 0
        finished = self._submitter.pop_finished()
        for status in finished:
            job = self.outstanding.pop(status.job_id, None)
            if job is None:
                continue
            res = status.result
            if status.state.value == "done" and res is not None and res.audit.passed:
                swaps.append(
                    {
                        "sample_id": job.sample_id,
                        "image_path": res.output_path,
                        "boxes": res.boxes,
                        "description": job.description or None,
                        "job_id": job.job_id,
                        "parent": job.parent,
                        "query": job.query,
                        "level": job.level,
                        "scene": res.scene,
                    }
                )
                lags.append(now - job.submitted_at)
            else:
                failed += 1
                log.warning(
                    "synthesis job %s failed (the sample keeps its image): %s",
                    status.job_id,
                    status.error or (res.audit.message if res else "no result"),
                )
        self._submitter.ack([s.job_id for s in finished])
        dropped = 0
        if self.unfinished == "drop":
            dropped = len(self.outstanding)
            self.outstanding.clear()
        self.totals["swapped"] += len(swaps)
        self.totals["failed"] += failed
        self.totals["dropped"] += dropped
        stats = self._submitter.stats()
        report = {
            "swaps": len(swaps),
            "failures": failed,
            "dropped": dropped,
            "outstanding": len(self.outstanding),
            "lag_s": sum(lags) / len(lags) if lags else 0.0,
            "queue_depth": stats["unsent"] + stats["in_flight"],
            "server_restarts": self.totals["server_restarts"],
            **self.strategy.stats(),
        }
        return swaps, report

    # ------------------------------------------------------------------------------------------------ gallery
    def _write_gallery(self, trainer: L.Trainer) -> None:
        if self.gallery_samples <= 0:
            return
        from callbacks.gallery import lineage_strip

        evolved = [sid for sid in self._pool.order if len(self._pool.entries[sid].versions) > 1]
        if not evolved:
            return
        out_dir = Path(self.gallery_dir) if self.gallery_dir else Path(trainer.default_root_dir) / "lineage"
        out_dir.mkdir(parents=True, exist_ok=True)
        images = []
        max_epochs = trainer.max_epochs if trainer.max_epochs and trainer.max_epochs > 0 else None
        for sid in evolved[: self.gallery_samples]:
            strip = lineage_strip(
                self._pool.lineage(sid), query=self._pool.entries[sid].record.query, max_epochs=max_epochs
            )
            strip.save(out_dir / f"{sid}.png")  # one strip per sample, the whole lineage (rewritten at each swap)
            images.append(strip)
        for logger in trainer.loggers:
            if hasattr(logger, "log_image"):
                try:
                    logger.log_image(key="synth/lineage", images=images, step=trainer.global_step)
                except Exception as err:  # a logger's image support must never stop training
                    log.warning("could not log the lineage gallery to %s: %s", type(logger).__name__, err)

    # ------------------------------------------------------------------------------------------------ state
    def state_dict(self) -> dict[str, Any]:
        return {
            "outstanding": {k: asdict(v) for k, v in self.outstanding.items()},
            "totals": dict(self.totals),
            "history": list(self.history),
            "last_boundary": self.last_boundary,
            "pending_edits": dict(self.pending_edits),
            "strategy": self.strategy.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.outstanding = {k: Outstanding(**v) for k, v in state.get("outstanding", {}).items()}
        self.totals.update(state.get("totals", {}))
        self.history = list(state.get("history", []))
        epochs = [h["epoch"] for h in self.history if "epoch" in h]
        self.last_boundary = state.get("last_boundary", max(epochs, default=-1))
        self.pending_edits = dict(state.get("pending_edits", {}))
        self.strategy.load_state_dict(state.get("strategy", {}))


def _guard(description: str, meta: dict[str, Any]) -> str:
    if not meta.get("objects"):
        return description
    from core.toy.scene import guard_description

    return guard_description(description, meta)
