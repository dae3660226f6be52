"""The data server: an HTTP front (FastAPI + uvicorn) over one painter process per device.

    python -m synth.server --config configs/synth/procedural.yaml [--port 0 --port-file PATH] [--set key=value ...]

The HTTP process validates requests, keeps the job table and hands jobs to worker processes (``synth.worker``); it
never imports torch or a diffusers pipeline. Guarantees (docs/data_server.md has the full note):

- Idempotent jobs: ``POST /jobs`` with a known ``job_id`` returns that job (same body) or 409 (different body).
- Bounded: at most ``max_queued`` queued jobs (429 beyond) and ``max_jobs_held`` held ones; bodies up to
  ``max_request_bytes`` (413).
- Nothing lost to a crash: a job whose worker dies or times out is retried (alone) up to ``max_attempts`` times, then
  failed with the reason; the worker is restarted; other jobs are untouched.
- Outputs are written atomically, audited on disk before they appear, and never over an input; results stay until
  the client acknowledges them (``POST /jobs/{id}/ack`` or ``DELETE /jobs/{id}``).
- Bearer-token auth on every endpoint, loopback by default, images read only under the configured roots.
"""

import argparse
import base64
import collections
import contextlib
import hmac
import io
import logging
import multiprocessing as mp
import os
import re
import signal
import socket
import sys
import threading
import time
import typing
import uuid
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait
from pathlib import Path
from typing import Any

from PIL import Image
from pydantic import ValidationError

from synth.api import (
    API_VERSION,
    JOB_ID_PATTERN,
    Ack,
    AuditResult,
    ErrorBody,
    Health,
    JobList,
    JobRequest,
    JobResult,
    JobState,
    JobStatus,
    Timings,
    WorkerInfo,
)
from synth.compose import CanvasGeometry
from synth.config import ServerConfig, load_config

log = logging.getLogger("synth.server")

API_DOC = (
    "Repaints the background of training images after a description and keeps the boxes' foreground exactly. "
    "Every endpoint needs `Authorization: Bearer <token>`; every error answer is an `ErrorBody`. "
    "See docs/data_server.md."
)


class ApiError(Exception):
    """An error answer: HTTP status, a message that says what to fix, optional per-field errors."""

    def __init__(self, status: int, detail: str, errors: list[dict] | None = None, headers: dict | None = None):
        super().__init__(detail)
        self.status, self.detail, self.errors, self.headers = status, detail, errors, headers


def validation_errors(e: ValidationError) -> list[dict]:
    """Pydantic errors as ``{"field": "boxes.0", "message": ...}`` (the field path joined with dots)."""
    return [
        {"field": ".".join(str(p) for p in err["loc"]) or "body", "message": err["msg"], "type": err["type"]}
        for err in e.errors(include_url=False)
    ]


# --- request checks (HTTP process; PIL reads only the image header) ------------------------------------------------


@dataclass
class PreparedInput:
    image_path: str | None
    image_bytes: bytes | None
    width: int
    height: int
    boxes: list[list[float]]
    """The request's boxes clipped to the image (they may stick out by at most ``box_tolerance_px``)."""
    output_path: str


def _resolve_image_path(path: str, cfg: ServerConfig) -> str:
    roots = cfg.resolved_roots()
    if not roots:
        raise ApiError(
            403,
            "this server has no roots configured, so it reads no files: send image.data_b64, "
            "or start the server with roots: [<dir>] in its config",
        )
    p = Path(path)
    if not p.is_absolute():
        p = roots[0] / p
    try:
        real = Path(os.path.realpath(p))
    except (OSError, ValueError) as e:  # a NUL byte (ValueError), a symlink loop, ...
        raise ApiError(400, f"image.path {path!r} cannot be resolved on the server: {e}") from e
    if not any(real == r or real.is_relative_to(r) for r in roots):
        raise ApiError(
            403,
            f"image.path {path!r} resolves to {str(real)!r}, outside the server's roots {[str(r) for r in roots]}: "
            "put the image under a root or add its directory to roots in the server config",
        )
    try:
        exists, is_file = real.exists(), real.is_file()
    except OSError as e:  # ENAMETOOLONG, EACCES on a parent, ...: the client's path is unusable, not a server fault
        raise ApiError(400, f"image.path {path!r} cannot be read on the server: {e.strerror or e}") from e
    if not exists:
        raise ApiError(400, f"image.path {path!r} does not exist on the server (looked at {str(real)!r})")
    if not is_file:
        raise ApiError(400, f"image.path {path!r} is not a file on the server (looked at {str(real)!r})")
    return str(real)


def _image_size(source: Any, what: str, cfg: ServerConfig) -> tuple[int, int]:
    try:
        with Image.open(source) as im:
            w, h = im.size
    except Image.DecompressionBombError as e:
        raise ApiError(413, f"{what} is too large to decode: {e}") from e
    except Exception as e:
        raise ApiError(422, f"{what} is not a readable image: {type(e).__name__}: {e}") from e
    if w * h > cfg.max_image_pixels:
        raise ApiError(
            413, f"{what} is {w} x {h} = {w * h} pixels, above the server's max_image_pixels ({cfg.max_image_pixels})"
        )
    return w, h


def prepare_input(req: JobRequest, cfg: ServerConfig) -> PreparedInput:
    """Check a request against the server's limits and its image; raise ApiError with a clear message."""
    out_dir = cfg.resolved_output_dir()
    output_path = str(out_dir / f"{req.job_id}.png")
    if req.image.path is not None:
        image_path, image_bytes = _resolve_image_path(req.image.path, cfg), None
        if image_path == output_path:
            raise ApiError(
                422,
                f"image.path {req.image.path!r} is this job's own output file; "
                "the server never overwrites an input: choose another job_id",
            )
        w, h = _image_size(image_path, f"image.path {req.image.path!r}", cfg)
    else:
        try:
            image_bytes = req.image.decoded()
        except ValueError as e:
            raise ApiError(422, str(e), [{"field": "image.data_b64", "message": str(e)}]) from e
        image_path = None
        w, h = _image_size(io.BytesIO(image_bytes), "image.data_b64", cfg)
    scene = req.edit.scene if req.edit is not None else None
    if scene is not None and (scene.get("width"), scene.get("height")) != (w, h):
        msg = (
            f"edit.scene is a {scene.get('width')} x {scene.get('height')} scene but the image is {w} x {h}: "
            "send the scene that describes this image"
        )
        raise ApiError(422, msg, [{"field": "edit.scene", "message": msg}])
    tol = cfg.box_tolerance_px
    boxes = []
    for i, b in enumerate(req.boxes):
        x1, y1, x2, y2 = b
        if x1 < -tol or y1 < -tol or x2 > w + tol or y2 > h + tol:
            msg = f"boxes[{i}] = {b} lies outside the {w} x {h} image (by more than box_tolerance_px = {tol})"
            raise ApiError(422, msg, [{"field": f"boxes.{i}", "message": msg}])
        c = [max(0.0, x1), max(0.0, y1), min(float(w), x2), min(float(h), y2)]
        if c[2] <= c[0] or c[3] <= c[1]:
            msg = f"boxes[{i}] = {b} is empty once clipped to the {w} x {h} image"
            raise ApiError(422, msg, [{"field": f"boxes.{i}", "message": msg}])
        boxes.append(c)
    try:
        geom = CanvasGeometry.from_params(w, h, **req.canvas.model_dump())
    except ValueError as e:
        raise ApiError(422, str(e), [{"field": "canvas", "message": str(e)}]) from e
    if geom.canvas_w * geom.canvas_h > cfg.max_canvas_pixels:
        msg = (
            f"the canvas would be {geom.canvas_w} x {geom.canvas_h} pixels, above the server's max_canvas_pixels "
            f"({cfg.max_canvas_pixels}): lower canvas.scale / canvas.extend"
        )
        raise ApiError(422, msg, [{"field": "canvas", "message": msg}])
    return PreparedInput(image_path, image_bytes, w, h, boxes, output_path)


# --- job table and workers -----------------------------------------------------------------------------------------

TEMP_NAME = re.compile(r"^\..+\.[0-9a-f]{32}\.tmp$")
"""Worker temp files in ``output_dir``: ``.<output name>.<job uid>.tmp``. One server per ``output_dir``: at start-up
it removes every such file (a worker killed mid-write leaves one; the server killed with workers mid-write does too)."""


def temp_path(output_path: str, uid: str) -> str:
    """Where a job's worker writes before the server publishes the file as ``output_path``."""
    head, name = os.path.split(output_path)
    return os.path.join(head, f".{name}.{uid}.tmp")


def _unlink_quietly(path: str | None) -> None:
    if path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@dataclass
class _Job:
    uid: str
    request: JobRequest
    """The request with ``image.data_b64`` dropped (the decoded bytes live in ``inp`` until the job finishes)."""
    fingerprint: str
    inp: PreparedInput | None
    state: JobState = JobState.queued
    attempts: int = 0
    cursor: int = 0
    solo: bool = False
    """Run alone: set after a crash, so a job that kills its worker cannot take batch-mates down with it."""
    result: dict | None = None
    error: str | None = None
    created_at: float = field(default_factory=time.time)
    started_at: float | None = None
    finished_at: float | None = None
    run_s: float | None = None
    paint_s: float | None = None


@dataclass
class _Worker:
    index: int
    device: str
    proc: Any = None
    conn: Any = None
    pid: int | None = None
    ready: bool = False
    busy: list[str] = field(default_factory=list)
    """uids of the jobs the worker is running."""
    busy_ids: list[str] = field(default_factory=list)
    """Their job ids (a job cancelled while running stays here until its worker finishes)."""
    temps: list[str] = field(default_factory=list)
    """Temp files the busy jobs write (removed if the worker dies before the server publishes or discards them)."""
    deadline: float | None = None
    started: float = 0.0
    restarts: int = 0
    start_failures: int = 0
    """Consecutive starts that never became ready."""
    next_start: float = 0.0
    error: str | None = None
    given_up: bool = False


class Unavailable(ApiError):
    pass


class JobManager:
    """Job table, queue and worker processes. Every worker event is handled on one dispatcher thread."""

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self._lock = threading.Lock()
        self._jobs: collections.OrderedDict[str, _Job] = collections.OrderedDict()  # ordered by cursor
        self._by_uid: dict[str, _Job] = {}
        self._pending: collections.deque[str] = collections.deque()  # uids
        self._counts: collections.Counter[str] = collections.Counter()
        self._cursor = 0
        self._workers = [_Worker(i, d) for i, d in enumerate(cfg.devices)]
        self._ctx = mp.get_context("spawn")
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._started_at = time.time()
        self.server_id = uuid.uuid4().hex[:12]
        self.output_dir = cfg.resolved_output_dir()

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.sweep_temp_files()
        for w in self._workers:
            self._spawn(w)
        self._thread = threading.Thread(target=self._run, name="synth-dispatcher", daemon=True)
        self._thread.start()

    def sweep_temp_files(self) -> int:
        """Remove worker temp files left in ``output_dir`` by a run that was killed mid-write; returns how many."""
        n = 0
        for entry in os.scandir(self.output_dir):
            if TEMP_NAME.match(entry.name) and entry.is_file(follow_symlinks=False):
                _unlink_quietly(entry.path)
                n += 1
        if n:
            log.warning("removed %d temp files left in %s by an earlier run", n, self.output_dir)
        return n

    def begin_shutdown(self) -> None:
        """Stop restarting workers (called on SIGINT / SIGTERM, which may also reach the workers)."""
        self._stop.set()
        self._wake()

    def stop(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._wake()
        if self._thread is not None:
            self._thread.join(timeout)
        for w in self._workers:
            if w.conn is not None:
                with contextlib.suppress(OSError, ValueError):
                    w.conn.send(None)
        deadline = time.time() + timeout
        for w in self._workers:
            if w.proc is not None:
                w.proc.join(max(0.1, deadline - time.time()))
                if w.proc.is_alive():
                    w.proc.kill()
                    w.proc.join(5)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _spawn(self, w: _Worker) -> None:
        from synth.worker import worker_main

        parent, child = self._ctx.Pipe(duplex=True)
        painter = {"name": self.cfg.painter.name, **self.cfg.painter.kwargs()}
        fg = {"name": self.cfg.foreground.name, **self.cfg.foreground.kwargs()}
        proc = self._ctx.Process(
            target=worker_main,
            args=(w.index, w.device, painter, fg, self.cfg.threads_per_worker, child),
            name=f"synth-worker-{w.index}",
            daemon=True,
        )
        proc.start()
        child.close()
        w.proc, w.conn, w.pid, w.ready, w.deadline = proc, parent, proc.pid, False, None
        w.busy, w.busy_ids, w.temps = [], [], []
        w.started = time.time()
        log.info("worker %d (%s) started, pid %d", w.index, w.device, proc.pid)

    # -- the dispatcher thread ------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stop.is_set():
            objs: list[Any] = [self._wake_r]
            for w in self._workers:
                if w.proc is not None:
                    objs += [w.conn, w.proc.sentinel]
            try:
                ready = mp_wait(objs, timeout=min(0.5, self.cfg.batch_window_s or 0.5))
            except OSError:
                ready = []
            if self._wake_r in ready:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
            for w in self._workers:
                if w.proc is None:
                    continue
                if w.conn in ready or w.proc.sentinel in ready:
                    self._drain(w)
                if w.proc is not None and not w.proc.is_alive():
                    self._drain(w)
                    self._on_exit(w, self._exit_reason(w))
            try:
                self._check_deadlines()
                self._restart_due()
                self._dispatch()
            except Exception:  # never let the dispatcher die
                log.exception("dispatcher error")

    def _exit_reason(self, w: _Worker) -> str:
        w.proc.join(1.0)
        code = w.proc.exitcode
        if code is None:
            return "stopped answering"
        if code < 0:
            with contextlib.suppress(ValueError):
                return f"was killed by {signal.Signals(-code).name}"
            return f"was killed by signal {-code}"
        return f"exited with code {code}"

    def _drain(self, w: _Worker) -> None:
        """Read every message the worker has sent (results first, even from a worker that died after sending)."""
        while w.conn is not None:
            try:
                if not w.conn.poll():
                    return
                msg = w.conn.recv()
            except (EOFError, OSError):
                return
            kind = msg[0]
            with self._lock:
                if kind == "ready":
                    w.ready, w.pid, w.start_failures, w.error = True, msg[1], 0, None
                    log.info("worker %d (%s) ready, pid %d", w.index, w.device, w.pid)
                elif kind == "error":
                    w.error = msg[1]
                    log.error("%s", msg[1])
                elif kind == "done":
                    self._apply_results(w, msg[1])

    def _apply_results(self, w: _Worker, results: list[dict]) -> None:
        """Publish or discard a batch's results (caller holds the lock, so an ``ack`` cannot interleave)."""
        now = time.time()
        for r in results:
            job = self._by_uid.get(r["uid"])
            if job is None or job.state != JobState.running or self._jobs.get(job.request.job_id) is not job:
                _unlink_quietly(r.get("tmp_path"))  # cancelled while running: its file must never replace another's
                continue
            job.run_s, job.paint_s, job.finished_at = r.get("run_s"), r.get("paint_s"), now
            if r["ok"]:
                try:
                    os.replace(r["tmp_path"], r["result"]["output_path"])
                except OSError as e:
                    _unlink_quietly(r.get("tmp_path"))
                    job.error = f"could not publish the output {r['result']['output_path']!r}: {e}"
                    self._set_state(job, JobState.failed)
                else:
                    job.result = r["result"]
                    self._set_state(job, JobState.done)
            else:
                job.error = r["error"]
                self._set_state(job, JobState.failed)
            job.inp = None  # drop decoded bytes
        w.busy, w.busy_ids, w.temps, w.deadline = [], [], [], None

    def _on_exit(self, w: _Worker, reason: str) -> None:
        """A worker process ended: retry or fail its jobs, then schedule a restart (or give the worker up)."""
        now = time.time()
        with self._lock:
            was_ready = w.ready
            for uid in w.busy:
                job = self._by_uid.get(uid)
                if job is None or job.state != JobState.running:
                    continue
                if job.attempts >= self.cfg.max_attempts:
                    job.error = (
                        f"worker {w.index} ({w.device}) {reason} while running this job, on attempt "
                        f"{job.attempts} of max_attempts = {self.cfg.max_attempts}; giving up"
                    )
                    job.finished_at = now
                    job.inp = None
                    self._set_state(job, JobState.failed)
                else:
                    job.solo = True
                    self._set_state(job, JobState.queued)
                    self._pending.appendleft(job.uid)
            for tmp in w.temps:  # a worker killed mid-write leaves a partial temp file
                _unlink_quietly(tmp)
            w.busy, w.busy_ids, w.temps, w.deadline, w.ready = [], [], [], None, False
            with contextlib.suppress(OSError):
                w.conn.close()
            w.proc, w.conn = None, None
            if self._stop.is_set():
                return
            if was_ready:
                w.start_failures = 0
            else:
                w.start_failures += 1
                w.error = w.error or f"worker {w.index} ({w.device}) {reason} before its painter was ready"
            if w.start_failures > self.cfg.max_restarts:
                w.given_up = True
                log.error(
                    "worker %d (%s) given up after %d failed starts: %s", w.index, w.device, w.start_failures, w.error
                )
                self._fail_all_if_no_workers()
            else:
                w.next_start = now + (0.0 if was_ready else min(30.0, 0.5 * 2 ** (w.start_failures - 1)))
            log.warning("worker %d (%s) %s", w.index, w.device, reason)

    def _fail_all_if_no_workers(self) -> None:
        if not all(w.given_up for w in self._workers):
            return
        msg = f"no worker can start: {self._workers[0].error}"
        for uid in list(self._pending):
            job = self._by_uid.get(uid)
            if job is not None and job.state == JobState.queued:
                job.error, job.finished_at, job.inp = msg, time.time(), None
                self._set_state(job, JobState.failed)
        self._pending.clear()

    def _kill(self, w: _Worker, reason: str) -> None:
        if w.proc is not None and w.proc.is_alive():
            w.proc.kill()
            w.proc.join(5)
        self._drain(w)
        self._on_exit(w, reason)

    def _check_deadlines(self) -> None:
        now = time.time()
        for w in self._workers:
            if w.proc is None:
                continue
            if w.busy and w.deadline is not None and now > w.deadline:
                n = len(w.busy)
                self._kill(w, f"timed out (job_timeout_s = {self.cfg.job_timeout_s} per job, batch of {n})")
            elif not w.ready and now - w.started > self.cfg.startup_timeout_s:
                self._kill(w, f"did not load its painter within startup_timeout_s = {self.cfg.startup_timeout_s}")

    def _restart_due(self) -> None:
        now = time.time()
        for w in self._workers:
            if w.proc is None and not w.given_up and now >= w.next_start and not self._stop.is_set():
                w.restarts += 1
                self._spawn(w)

    def _wait_for_batch(self, now: float) -> bool:
        """True while fewer than ``batch_size`` jobs are queued and the oldest has waited less than the window."""
        window = self.cfg.batch_window_s
        if window <= 0 or len(self._pending) >= self.cfg.batch_size:
            return False
        oldest = self._by_uid.get(self._pending[0])
        return oldest is not None and now - oldest.created_at < window

    def _dispatch(self) -> None:
        plans = []
        with self._lock:
            now = time.time()
            for w in self._workers:
                if not (w.proc is not None and w.ready and not w.busy and self._pending):
                    continue
                if self._wait_for_batch(now):
                    break
                batch: list[_Job] = []
                while self._pending and len(batch) < self.cfg.batch_size:
                    job = self._by_uid.get(self._pending[0])
                    if job is None or job.state != JobState.queued:
                        self._pending.popleft()
                        continue
                    if job.solo and batch:
                        break
                    self._pending.popleft()
                    batch.append(job)
                    if job.solo:
                        break
                if not batch:
                    continue
                items = []
                for job in batch:
                    job.attempts += 1
                    job.started_at = now
                    self._set_state(job, JobState.running)
                    inp = job.inp
                    items.append(
                        dict(
                            uid=job.uid,
                            job_id=job.request.job_id,
                            image_path=inp.image_path,
                            image_bytes=inp.image_bytes,
                            boxes=inp.boxes,
                            description=job.request.description,
                            seed=job.request.seed,
                            canvas=job.request.canvas.model_dump(),
                            edit=None if job.request.edit is None else job.request.edit.model_dump(),
                            output_path=inp.output_path,
                            tmp_path=temp_path(inp.output_path, job.uid),
                            fsync=self.cfg.fsync_outputs,
                        )
                    )
                w.busy, w.busy_ids = [j.uid for j in batch], [j.request.job_id for j in batch]
                w.temps = [it["tmp_path"] for it in items]
                w.deadline = now + self.cfg.job_timeout_s * len(batch)
                plans.append((w, items))
        for w, items in plans:
            try:
                w.conn.send(items)
            except (OSError, ValueError):
                self._kill(w, "could not be reached")

    # -- table operations (HTTP handlers) -------------------------------------------------------------------------

    def _set_state(self, job: _Job, state: JobState) -> None:
        """Change state and bump the job's cursor (caller holds the lock)."""
        if job.request.job_id in self._jobs and self._jobs[job.request.job_id] is job:
            self._counts[job.state.value] -= 1
            self._counts[state.value] += 1
            self._cursor += 1
            job.cursor = self._cursor
            self._jobs.move_to_end(job.request.job_id)
        job.state = state

    def lookup(self, job_id: str, fingerprint: str) -> JobStatus | None:
        """The existing job for an idempotent resubmission, None if new; 409 when the body differs."""
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                return None
            if job.fingerprint != fingerprint:
                raise ApiError(
                    409,
                    f"job_id {job_id!r} already exists with a different request; a job_id names "
                    "one request: resubmit the same body, or use a new job_id",
                )
            return self._status(job)

    def submit(self, req: JobRequest, fingerprint: str, inp: PreparedInput) -> tuple[JobStatus, bool]:
        with self._lock:
            existing = self._jobs.get(req.job_id)
            if existing is not None:  # raced with an identical submission
                if existing.fingerprint != fingerprint:
                    raise ApiError(409, f"job_id {req.job_id!r} already exists with a different request")
                return self._status(existing), False
            if self._workers and all(w.given_up for w in self._workers):
                raise ApiError(503, f"no worker can start, so no job can run: {self._workers[0].error}")
            if self._counts[JobState.queued.value] >= self.cfg.max_queued:
                raise ApiError(
                    429, f"queue full ({self.cfg.max_queued} jobs queued): retry later", headers={"Retry-After": "1"}
                )
            if len(self._jobs) >= self.cfg.max_jobs_held:
                raise ApiError(
                    429,
                    f"the server holds {len(self._jobs)} jobs (max_jobs_held): acknowledge finished "
                    "jobs (POST /jobs/{id}/ack) to free room",
                    headers={"Retry-After": "1"},
                )
            stored = req.model_copy(update={"image": req.image.model_copy(update={"data_b64": None})})
            job = _Job(uid=uuid.uuid4().hex, request=stored, fingerprint=fingerprint, inp=inp)
            self._jobs[req.job_id] = job
            self._by_uid[job.uid] = job
            self._counts[JobState.queued.value] += 1
            self._cursor += 1
            job.cursor = self._cursor
            self._pending.append(job.uid)
            status = self._status(job)
        self._wake()
        return status, True

    def get(self, job_id: str, include_image: bool = False) -> JobStatus:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                raise ApiError(404, f"no job {job_id!r} (never submitted, or already acknowledged)")
            status = self._status(job)
        if status.result is not None and (include_image or job.request.return_bytes):
            try:
                data = Path(status.result.output_path).read_bytes()
            except OSError as e:
                raise ApiError(410, f"the output of job {job_id!r} is no longer on disk: {e}") from e
            status.result.image_b64 = base64.b64encode(data).decode("ascii")
        return status

    def output_file(self, job_id: str) -> str:
        with self._lock:
            job = self._jobs.get(job_id)
            if job is None:
                raise ApiError(404, f"no job {job_id!r} (never submitted, or already acknowledged)")
            if job.state != JobState.done:
                raise ApiError(409, f"job {job_id!r} is {job.state.value}, not done: it has no image")
            return job.result["output_path"]

    def list(self, states: list[JobState] | None, since: int, limit: int) -> JobList:
        wanted = set(states) if states else None
        out: list[JobStatus] = []
        truncated = False
        with self._lock:
            cursor = self._cursor
            for job in reversed(self._jobs.values()):  # newest change first
                if job.cursor <= since:
                    break
                if wanted is None or job.state in wanted:
                    out.append(self._status(job))
            out.reverse()
            if len(out) > limit:
                out, truncated = out[:limit], True
        return JobList(jobs=out, cursor=out[-1].cursor if truncated else cursor, server_id=self.server_id)

    def ack(self, job_id: str) -> Ack:
        with self._lock:
            job = self._jobs.pop(job_id, None)
            if job is None:
                return Ack(job_id=job_id, acknowledged=False)
            self._by_uid.pop(job.uid, None)
            self._counts[job.state.value] -= 1
            job.inp = None
            cancelled = job.state in (JobState.queued, JobState.running)
        if cancelled:
            log.info("job %s cancelled while %s", job_id, job.state.value)
        return Ack(job_id=job_id, acknowledged=True, cancelled=cancelled)

    def health(self) -> Health:
        with self._lock:
            workers = [
                WorkerInfo(
                    index=w.index,
                    device=w.device,
                    pid=w.pid if w.proc is not None else None,
                    alive=w.proc is not None and w.proc.is_alive(),
                    ready=w.ready,
                    busy=list(w.busy_ids),
                    restarts=w.restarts,
                    error=w.error,
                )
                for w in self._workers
            ]
            n_ready = sum(w.ready for w in workers)
            if all(w.given_up for w in self._workers):
                status = "failed"
            elif n_ready == len(workers):
                status = "ok"
            elif any(w.given_up for w in self._workers) or (n_ready and n_ready < len(workers)):
                status = "degraded"
            else:
                status = "starting"
            return Health(
                server_id=self.server_id,
                status=status,
                painter=self.cfg.painter.name,
                foreground=self.cfg.foreground.name,
                workers=workers,
                queue_depth=self._counts[JobState.queued.value],
                queue_capacity=self.cfg.max_queued,
                counts={s.value: self._counts[s.value] for s in JobState},
                uptime_s=time.time() - self._started_at,
            )

    def _status(self, job: _Job) -> JobStatus:
        result = None
        if job.result is not None and job.state == JobState.done:
            r = dict(job.result)
            result = JobResult(**{**r, "audit": AuditResult(**r["audit"])})
        return JobStatus(
            job_id=job.request.job_id,
            sample_id=job.request.sample_id,
            state=job.state,
            attempts=job.attempts,
            cursor=job.cursor,
            result=result,
            error=job.error,
            timings=Timings(
                created_at=job.created_at,
                started_at=job.started_at,
                finished_at=job.finished_at,
                queue_s=None if job.started_at is None else job.started_at - job.created_at,
                run_s=job.run_s,
                paint_s=job.paint_s,
            ),
        )


# --- the HTTP app --------------------------------------------------------------------------------------------------


def _error_responses(*codes: int) -> dict[int, dict]:
    """OpenAPI ``responses`` entries for error answers, all with the :class:`ErrorBody` shape."""
    what = {
        400: "The body is not JSON, or image.path cannot be used",
        401: "Missing or wrong bearer token",
        403: "image.path resolves outside the server's roots",
        404: "No such job (never submitted, or acknowledged), or no such route (a job_id holding '/')",
        409: "The job_id exists with a different request, or the job has no image yet",
        410: "The job's output file is no longer on disk",
        413: "The body or the image is too large",
        422: "A field is invalid (``errors`` says which)",
        429: "Queue full or too many jobs held: retry after ``Retry-After`` seconds",
        503: "No worker can start",
    }
    out: dict[int, dict] = {}
    for code in codes:
        out[code] = {"model": ErrorBody, "description": what[code]}
        if code == 429:
            out[code]["headers"] = {"Retry-After": {"schema": {"type": "integer"}, "description": "seconds"}}
        if code == 401:
            out[code]["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
    return out


def _is_sequence(annotation: Any) -> bool:
    """``list[X]``, ``list[X] | None``, ...: a query parameter that may repeat."""
    origin = typing.get_origin(annotation)
    if origin in (list, tuple, set, frozenset):
        return True
    return any(_is_sequence(a) for a in typing.get_args(annotation)) if origin is not None else False


def _docs_enabled(cfg: ServerConfig) -> bool:
    return cfg.docs if cfg.docs is not None else _is_loopback(cfg.host)


def create_app(cfg: ServerConfig, token: str | None, manager: JobManager | None = None):
    """The FastAPI app. ``token`` None disables auth (only allowed on loopback; checked in ``main``).

    Every route, the schema and its viewers included, sits behind the bearer token (the app-wide dependency); the
    viewers exist only when ``cfg.docs`` allows (default: on a loopback host). The OpenAPI schema declares the
    request body of ``POST /jobs``, every error answer as :class:`ErrorBody`, and the bearer scheme.

    (This module has no ``from __future__ import annotations``: FastAPI reads the handlers' annotations at run time.)
    """
    from fastapi import Depends, FastAPI, Query, Request
    from fastapi import Path as PathParam
    from fastapi.exceptions import RequestValidationError
    from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
    from fastapi.openapi.utils import get_openapi
    from fastapi.responses import JSONResponse, StreamingResponse
    from starlette.concurrency import run_in_threadpool
    from starlette.exceptions import HTTPException as StarletteHTTPException

    manager = manager or JobManager(cfg)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        manager.start()
        try:
            yield
        finally:
            await run_in_threadpool(manager.stop)

    async def auth(request: Request) -> None:
        if token is None:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise ApiError(
                401,
                "missing or wrong bearer token: send 'Authorization: Bearer <token>' with the "
                f"server's token (from ${cfg.token_env} or token_file)",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def known_query(request: Request) -> None:
        """Unknown query parameters are a 422, as unknown body fields are: a typo (``?stat=done``) never passes."""
        route = request.scope.get("route")
        dependant = getattr(route, "dependant", None)
        if dependant is None or not request.query_params:
            return
        params = list(dependant.query_params)
        for d in dependant.dependencies:
            params += d.query_params
        known = {p.alias for p in params}
        for p in params:  # a scalar given twice (?since=1&since=2): which one was meant is a guess, so refuse
            n = len(request.query_params.getlist(p.alias))
            if n > 1 and not _is_sequence(p.field_info.annotation):
                msg = f"query parameter {p.alias!r} takes one value, got {n}"
                raise ApiError(422, msg, [{"field": f"query.{p.alias}", "message": msg}])
        unknown = sorted(set(request.query_params) - known)
        if unknown:
            errors = [{"field": f"query.{k}", "message": "unknown query parameter"} for k in unknown]
            raise ApiError(
                422,
                f"unknown query parameter(s) {unknown} for {request.method} {route.path}: "
                f"this endpoint takes {sorted(known) or 'none'}",
                errors,
            )

    # The built-in /openapi.json, /docs and /redoc bypass app-wide dependencies: they are added below, behind auth.
    app = FastAPI(
        title="Syn-GRPO data server",
        version=API_VERSION,
        lifespan=lifespan,
        dependencies=[Depends(auth), Depends(known_query)],
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.manager = manager

    def error_response(status: int, detail: str, errors=None, headers=None) -> JSONResponse:
        body = ErrorBody(detail=detail, errors=errors).model_dump(exclude_none=True)
        return JSONResponse(body, status_code=status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return error_response(e.status, e.detail, e.errors, e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        errors = [
            {"field": ".".join(str(p) for p in err["loc"]), "message": err["msg"], "type": err["type"]}
            for err in e.errors()
        ]
        return error_response(
            422, "invalid request: " + "; ".join(f"{x['field']}: {x['message']}" for x in errors), errors
        )

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail), headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):  # a bug: still an ErrorBody, and the traceback in the log
        log.exception("unexpected error in %s %s", request.method, request.url.path)
        return error_response(500, f"internal error ({type(e).__name__}); the server log has the traceback")

    async def read_body(request: Request) -> bytes:
        limit = cfg.max_request_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise ApiError(413, f"request body is {length} bytes, above the server's max_request_bytes ({limit})")
        chunks, n = [], 0
        async for chunk in request.stream():
            n += len(chunk)
            if n > limit:
                raise ApiError(413, f"request body exceeds the server's max_request_bytes ({limit})")
            chunks.append(chunk)
        return b"".join(chunks)

    # The body is read by hand (to stop reading at max_request_bytes and to tell bad JSON (400) from bad fields
    # (422)), so FastAPI does not see it: the schema is declared here.
    job_request_body = {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/JobRequest"}}},
        }
    }

    @app.post(
        "/jobs",
        response_model=JobStatus,
        status_code=202,
        openapi_extra=job_request_body,
        responses={
            200: {"model": JobStatus, "description": "A job with this job_id and the same body exists: that job"},
            **_error_responses(400, 401, 403, 409, 413, 422, 429, 503),
        },
    )
    async def submit(request: Request):
        body = await read_body(request)
        try:
            req = JobRequest.model_validate_json(body)
        except ValidationError as e:
            errors = validation_errors(e)
            if any(err["type"] == "json_invalid" for err in errors):
                raise ApiError(400, f"request body is not valid JSON: {errors[0]['message']}") from e
            detail = "invalid job request: " + "; ".join(f"{x['field']}: {x['message']}" for x in errors)
            raise ApiError(422, detail, errors) from e
        fingerprint = req.fingerprint()
        existing = manager.lookup(req.job_id, fingerprint)
        if existing is not None:
            return JSONResponse(existing.model_dump(mode="json"), status_code=200)
        inp = await run_in_threadpool(prepare_input, req, cfg)
        status, created = manager.submit(req, fingerprint, inp)
        return JSONResponse(status.model_dump(mode="json"), status_code=202 if created else 200)

    job_id_param = PathParam(pattern=JOB_ID_PATTERN, description="The client-chosen id of the job")

    @app.get("/jobs/{job_id}", response_model=JobStatus, responses=_error_responses(401, 404, 410, 422))
    async def get_job(job_id: str = job_id_param, include_image: bool = False):
        return await run_in_threadpool(manager.get, job_id, include_image)

    @app.get(
        "/jobs/{job_id}/image",
        response_class=StreamingResponse,
        responses={
            200: {"content": {"image/png": {"schema": {"type": "string", "format": "binary"}}}, "description": "PNG"},
            **_error_responses(401, 404, 409, 410, 422),
        },
    )
    async def get_image(job_id: str = job_id_param):
        path = manager.output_file(job_id)
        try:  # open first: the open handle outlives a removal, so the answer is the whole file or a 410, never a 500
            fh = await run_in_threadpool(open, path, "rb")
        except OSError as e:
            raise ApiError(410, f"the output of job {job_id!r} is no longer on disk: {e}") from e
        size = os.fstat(fh.fileno()).st_size

        def chunks():
            with fh:
                while block := fh.read(1 << 20):
                    yield block

        return StreamingResponse(chunks(), media_type="image/png", headers={"Content-Length": str(size)})

    @app.get("/jobs", response_model=JobList, responses=_error_responses(401, 422))
    async def list_jobs(
        state: list[JobState] | None = Query(None),
        since: int = Query(0, ge=0),
        limit: int = Query(1000, ge=1, le=10000),
    ):
        return manager.list(state, since, limit)

    @app.post("/jobs/{job_id}/ack", response_model=Ack, responses=_error_responses(401, 404, 422))
    async def ack(job_id: str = job_id_param):
        return manager.ack(job_id)

    @app.delete("/jobs/{job_id}", response_model=Ack, responses=_error_responses(401, 404, 422))
    async def delete(job_id: str = job_id_param):
        return manager.ack(job_id)

    @app.get("/health", response_model=Health, responses=_error_responses(401))
    async def health():
        return manager.health()

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(
                title=app.title,
                version=app.version,
                description=API_DOC,
                routes=app.routes,
                separate_input_output_schemas=False,
            )
            components = schema.setdefault("components", {})
            schemas = components.setdefault("schemas", {})
            body = JobRequest.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(body.pop("$defs", {}))
            schemas["JobRequest"] = body
            for name in ("HTTPValidationError", "ValidationError"):  # FastAPI's 422 shape: never sent here
                schemas.pop(name, None)
            components["securitySchemes"] = {"bearerAuth": {"type": "http", "scheme": "bearer"}}
            if token is not None:
                schema["security"] = [{"bearerAuth": []}]
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

    if _docs_enabled(cfg):

        @app.get("/openapi.json", include_in_schema=False)
        async def openapi_json():
            return JSONResponse(openapi())

        @app.get("/docs", include_in_schema=False)
        async def docs():
            return get_swagger_ui_html(openapi_url="/openapi.json", title=f"{app.title} - docs")

        @app.get("/redoc", include_in_schema=False)
        async def redoc():
            return get_redoc_html(openapi_url="/openapi.json", title=f"{app.title} - ReDoc")

    return app


# --- command line ----------------------------------------------------------------------------------------------------


def _is_loopback(host: str) -> bool:
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")


def _write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m synth.server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", help="YAML config (configs/synth/procedural.yaml, sdxl.yaml, ...)")
    parser.add_argument("--host", help="override host")
    parser.add_argument("--port", type=int, help="override port; 0 picks a free one")
    parser.add_argument("--port-file", help="write the port actually bound to this file (for --port 0)")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key (dotted, value read as YAML), e.g. --set roots=[data]",
    )
    parser.add_argument("--parent-pid", type=int, help="exit when this process is gone (set by LocalServer)")
    args = parser.parse_args(argv)

    overrides = list(args.set)
    if args.host is not None:
        overrides.append(f"host={args.host}")
    if args.port is not None:
        overrides.append(f"port={args.port}")
    try:
        cfg = load_config(args.config, overrides)
        token = cfg.read_token()
    except (OSError, ValueError, ValidationError) as e:
        print(f"synth.server: bad config: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if cfg.auth and not token:
        print(
            f"synth.server: no token: set ${cfg.token_env} or token_file in the config "
            "(or auth: false on a loopback host)",
            file=sys.stderr,
        )
        return 2
    if not cfg.auth:
        if not _is_loopback(cfg.host):
            print("synth.server: auth: false is only allowed on a loopback host", file=sys.stderr)
            return 2
        token = None

    import uvicorn

    family = socket.AF_INET6 if ":" in cfg.host else socket.AF_INET
    # proto=IPPROTO_TCP matters: asyncio sets TCP_NODELAY only on sockets that say so; without it, keep-alive
    # requests wait ~40 ms each for a delayed ACK (Nagle).
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((cfg.host, cfg.port))
    sock.listen(512)
    port = sock.getsockname()[1]

    manager = JobManager(cfg)
    app = create_app(cfg, token, manager)

    class _Server(uvicorn.Server):
        def handle_exit(self, sig, frame):
            manager.begin_shutdown()
            super().handle_exit(sig, frame)

    server = _Server(uvicorn.Config(app, log_level=cfg.log_level.lower(), access_log=False, lifespan="on"))

    if args.parent_pid:

        def watch_parent() -> None:
            while not server.should_exit:
                if os.getppid() != args.parent_pid:
                    log.warning("parent process %d is gone: shutting down", args.parent_pid)
                    server.should_exit = True
                time.sleep(1.0)

        threading.Thread(target=watch_parent, name="synth-parent-watch", daemon=True).start()

    host = f"[{cfg.host}]" if family == socket.AF_INET6 else cfg.host
    if args.port_file:
        _write_atomic(args.port_file, f"{port}\n")
    print(
        f"synth.server listening on http://{host}:{port} (painter={cfg.painter.name}, "
        f"foreground={cfg.foreground.name}, workers={cfg.devices}, output_dir={cfg.resolved_output_dir()})",
        flush=True,
    )
    server.run(sockets=[sock])
    return 0


if __name__ == "__main__":
    sys.exit(main())
