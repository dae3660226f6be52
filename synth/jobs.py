"""The job table and the worker processes behind the HTTP app (``synth.server``).

Jobs are keyed by (client id, ``job_id``): a client's operations reach only its own jobs (``synth.api``, "Clients and
their jobs"); ``client=None`` on :meth:`JobManager.list` is the admin's view of every client. Every worker event is
handled on one dispatcher thread; the HTTP handlers take the table's lock for their short reads and writes.
"""

import base64
import collections
import contextlib
import logging
import multiprocessing as mp
import os
import re
import signal
import stat
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait
from pathlib import Path
from typing import Any

from synth.api import (
    Ack,
    AuditResult,
    Health,
    JobList,
    JobRequest,
    JobResult,
    JobState,
    JobStatus,
    Timings,
    WorkerInfo,
)
from synth.beneath import LinkError, open_file, opened_dir, relative_parts
from synth.config import ServerConfig
from synth.inputs import ApiError, PreparedInput, file_identity, open_output

log = logging.getLogger("synth.server")

TEMP_NAME = re.compile(r"^\..+\.[0-9a-f]{32}\.tmp$")
"""Worker temp files in a client's output folder: ``.<output name>.<job uid>.tmp``. One server per ``output_dir``: at
start-up it removes every such file (a worker killed mid-write leaves one; the server killed with workers mid-write
does too)."""

Key = tuple[str, str]
"""A job's key in the table: (client id, job_id)."""


def temp_path(output_path: str, uid: str) -> str:
    """Where a job's worker writes before the server publishes the file as ``output_path``."""
    head, name = os.path.split(output_path)
    return os.path.join(head, f".{name}.{uid}.tmp")


def _unlink_below(output_dir: Path, path: str | None) -> bool:
    """Remove a file the server or a worker wrote below ``output_dir``, reaching it without following a link; whether
    a file was removed (not when a link stood on the way, or the file was gone or could not be removed)."""
    parts = relative_parts(path, output_dir) if path else None
    if not parts:
        return False
    try:
        with opened_dir(output_dir, parts[:-1]) as d:
            os.unlink(parts[-1], dir_fd=d)
    except (FileNotFoundError, LinkError, PermissionError):
        return False
    return True


def _publish(output_dir: Path, tmp_path: str, output_path: str, written: tuple[int, ...] | None) -> tuple[int, ...]:
    """Rename a worker's audited temp file over ``output_path`` inside the client's folder, reached from
    ``output_dir`` without following a link, only if it is still the file the worker wrote and audited (``written``:
    its :func:`synth.inputs.file_identity` once written: a file put in its place has another change time, an inode
    number reused or not) with one link; returns the published file's identity (taken after the rename, which sets
    its change time)."""
    parts, tmp_parts = relative_parts(output_path, output_dir), relative_parts(tmp_path, output_dir)
    if not parts or tmp_parts is None or tmp_parts[:-1] != parts[:-1]:
        raise OSError(f"{output_path!r} and its temp file are not in one folder below {str(output_dir)!r}")
    with opened_dir(output_dir, parts[:-1]) as d:
        fd = open_file(d, tmp_parts[-1])
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or file_identity(st) != tuple(written or ()):
                raise OSError(f"{tmp_path!r} is not the file the worker wrote and audited (replaced or linked)")
            os.replace(tmp_parts[-1], parts[-1], src_dir_fd=d, dst_dir_fd=d)
            return file_identity(os.fstat(fd))
        finally:
            os.close(fd)


@dataclass
class _Job:
    uid: str
    client: str
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
    output_identity: tuple[int, ...] | None = None
    """``synth.inputs.file_identity`` of the output the server published: only that file is ever served."""

    @property
    def key(self) -> Key:
        return self.client, self.request.job_id


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
    busy_ids: list[Key] = field(default_factory=list)
    """Their keys (a job cancelled while running stays here until its worker finishes)."""
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
        self._jobs: collections.OrderedDict[Key, _Job] = collections.OrderedDict()  # ordered by cursor
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
        self._ever_ready = False
        self.on_never_started: Callable[[str], None] | None = None
        """Called (on the dispatcher thread, with the reason) when every worker is given up and none was ever ready:
        ``python -m synth.server`` then exits non-zero rather than serve with no worker (a server started by
        :func:`create_app` alone keeps answering ``failed`` / 503)."""

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        self.sweep_temp_files()
        for w in self._workers:
            self._spawn(w)
        self._thread = threading.Thread(target=self._run, name="synth-dispatcher", daemon=True)
        self._thread.start()

    def sweep_temp_files(self) -> int:
        """Remove worker temp files left in ``output_dir`` and its client folders by a run that was killed mid-write;
        returns how many."""
        n = 0
        folders = [self.output_dir]
        folders += [Path(e.path) for e in os.scandir(self.output_dir) if e.is_dir(follow_symlinks=False)]
        for folder in folders:
            for entry in os.scandir(folder):
                if TEMP_NAME.match(entry.name) and entry.is_file(follow_symlinks=False):
                    n += _unlink_below(self.output_dir, entry.path)
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
            if job is None or job.state != JobState.running or self._jobs.get(job.key) is not job:
                _unlink_below(
                    self.output_dir, r.get("tmp_path")
                )  # cancelled while running: its file must never replace another's
                continue
            job.run_s, job.paint_s, job.finished_at = r.get("run_s"), r.get("paint_s"), now
            if r["ok"]:
                try:
                    job.output_identity = _publish(
                        self.output_dir, r["tmp_path"], r["result"]["output_path"], r.get("tmp_identity")
                    )
                except OSError as e:
                    _unlink_below(self.output_dir, r.get("tmp_path"))
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
                _unlink_below(self.output_dir, tmp)
            w.busy, w.busy_ids, w.temps, w.deadline, w.ready = [], [], [], None, False
            with contextlib.suppress(OSError):
                w.conn.close()
            w.proc, w.conn = None, None
            if self._stop.is_set():
                return
            if was_ready:
                w.start_failures = 0
                self._ever_ready = True
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
        if not self._ever_ready and self.on_never_started is not None:
            self.on_never_started(self._workers[0].error or msg)

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
                            image_identity=inp.image_identity,
                            image_root=inp.image_root,
                            image_parts=inp.image_parts,
                            image_bytes=inp.image_bytes,
                            boxes=inp.boxes,
                            description=job.request.description,
                            seed=job.request.seed,
                            canvas=job.request.canvas.model_dump(),
                            edit=None if job.request.edit is None else job.request.edit.model_dump(),
                            output_dir=str(self.output_dir),
                            output_path=inp.output_path,
                            tmp_path=temp_path(inp.output_path, job.uid),
                            fsync=self.cfg.fsync_outputs,
                        )
                    )
                w.busy, w.busy_ids = [j.uid for j in batch], [j.key for j in batch]
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
        if self._jobs.get(job.key) is job:
            self._counts[job.state.value] -= 1
            self._counts[state.value] += 1
            self._cursor += 1
            job.cursor = self._cursor
            self._jobs.move_to_end(job.key)
        job.state = state

    def lookup(self, client: str, job_id: str, fingerprint: str) -> JobStatus | None:
        """The client's existing job for an idempotent resubmission, None if new; 409 when the body differs."""
        with self._lock:
            job = self._jobs.get((client, job_id))
            if job is None:
                return None
            if job.fingerprint != fingerprint:
                raise ApiError(
                    409,
                    f"job_id {job_id!r} already exists with a different request; a job_id names "
                    "one request: resubmit the same body, or use a new job_id",
                )
            return self._status(job)

    def submit(self, client: str, req: JobRequest, fingerprint: str, inp: PreparedInput) -> tuple[JobStatus, bool]:
        with self._lock:
            existing = self._jobs.get((client, req.job_id))
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
            job = _Job(uid=uuid.uuid4().hex, client=client, request=stored, fingerprint=fingerprint, inp=inp)
            self._jobs[job.key] = job
            self._by_uid[job.uid] = job
            self._counts[JobState.queued.value] += 1
            self._cursor += 1
            job.cursor = self._cursor
            self._pending.append(job.uid)
            status = self._status(job)
        self._wake()
        return status, True

    def _find(self, client: str, job_id: str) -> _Job:
        job = self._jobs.get((client, job_id))
        if job is None:
            raise ApiError(404, f"no job {job_id!r} of client {client!r} (never submitted, or already acknowledged)")
        return job

    def get(self, client: str, job_id: str, include_image: bool = False) -> JobStatus:
        with self._lock:
            job = self._find(client, job_id)
            status = self._status(job)
        if status.result is not None and (include_image or job.request.return_bytes):
            with self.open_output(client, job_id) as fh:
                status.result.image_b64 = base64.b64encode(fh.read()).decode("ascii")
        return status

    def open_output(self, client: str, job_id: str):
        """The job's output PNG, opened: only the file the server published (never a link or a file put in its
        place); 409 before the job is done, 410 once the file is gone or replaced."""
        with self._lock:
            job = self._find(client, job_id)
            if job.state != JobState.done:
                raise ApiError(409, f"job {job_id!r} is {job.state.value}, not done: it has no image")
            path, identity = job.result["output_path"], job.output_identity
        try:
            return open_output(self.output_dir, path, identity)
        except OSError as e:
            raise ApiError(410, f"the output of job {job_id!r} is no longer on disk as written: {e}") from e

    def list(self, client: str | None, states: list[JobState] | None, since: int, limit: int) -> JobList:
        """The jobs of ``client`` (None: every client's, the admin's view) that changed after cursor ``since``."""
        wanted = set(states) if states else None
        out: list[JobStatus] = []
        truncated = False
        with self._lock:
            cursor = self._cursor
            for job in reversed(self._jobs.values()):  # newest change first
                if job.cursor <= since:
                    break
                if (client is None or job.client == client) and (wanted is None or job.state in wanted):
                    out.append(self._status(job))
            out.reverse()
            if len(out) > limit:
                out, truncated = out[:limit], True
        return JobList(jobs=out, cursor=out[-1].cursor if truncated else cursor, server_id=self.server_id)

    def ack(self, client: str, job_id: str) -> Ack:
        with self._lock:
            job = self._jobs.pop((client, job_id), None)
            if job is None:
                return Ack(job_id=job_id, acknowledged=False)
            self._by_uid.pop(job.uid, None)
            self._counts[job.state.value] -= 1
            job.inp = None
            cancelled = job.state in (JobState.queued, JobState.running)
        if cancelled:
            log.info("job %s cancelled while %s", job_id, job.state.value)
        return Ack(job_id=job_id, acknowledged=True, cancelled=cancelled)

    def health(self, client: str | None = None) -> Health:
        """The server's state; a worker's ``busy`` list names only ``client``'s jobs (None: the admin, every job)."""
        with self._lock:
            workers = [
                WorkerInfo(
                    index=w.index,
                    device=w.device,
                    pid=w.pid if w.proc is not None else None,
                    alive=w.proc is not None and w.proc.is_alive(),
                    ready=w.ready,
                    busy=[j for c, j in w.busy_ids if client is None or c == client],
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
                counts=self._client_counts(client),
                uptime_s=time.time() - self._started_at,
            )

    def _client_counts(self, client: str | None) -> dict[str, int]:
        """Jobs held by state: every client's (None, the admin's view), else only ``client``'s (caller holds the
        lock)."""
        if client is None:
            return {s.value: self._counts[s.value] for s in JobState}
        counts = collections.Counter(job.state.value for (c, _), job in self._jobs.items() if c == client)
        return {s.value: counts[s.value] for s in JobState}

    def _status(self, job: _Job) -> JobStatus:
        result = None
        if job.result is not None and job.state == JobState.done:
            r = dict(job.result)
            result = JobResult(**{**r, "audit": AuditResult(**r["audit"])})
        return JobStatus(
            job_id=job.request.job_id,
            client=job.client,
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
