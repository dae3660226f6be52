"""The data server's job manager behind the HTTP app (``synth.server``): the job table (``synth.job_table``), the
worker processes that run its jobs, and the dispatcher thread between them.

Every worker event is handled on one dispatcher thread; the HTTP handlers take the table's lock for their short reads
and writes. A finished job's output is published from the worker's temp file (``synth.outputs``).
"""

import contextlib
import logging
import multiprocessing as mp
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import wait as mp_wait
from typing import Any

from synth.api import Ack, Health, JobList, JobRequest, JobState, JobStatus, WorkerInfo
from synth.config import ServerConfig
from synth.inputs import ApiError, PreparedInput
from synth.job_table import JobTable, Key
from synth.outputs import publish, sweep_temp_files, unlink_below
from synth.worker import worker_main

log = logging.getLogger("synth.server")


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


class JobManager:
    """The job table and the worker processes: starts, supervises and restarts the workers, hands them batches of
    queued jobs and publishes their results. Every worker event is handled on one dispatcher thread."""

    def __init__(self, cfg: ServerConfig):
        self.cfg = cfg
        self._workers = [_Worker(i, d) for i, d in enumerate(cfg.devices)]
        self._ctx = mp.get_context("spawn")
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        self._thread: threading.Thread | None = None
        self._started_at = time.time()
        self.server_id = uuid.uuid4().hex[:12]
        self.output_dir = cfg.resolved_output_dir()
        self.table = JobTable(cfg, self.output_dir, self.server_id)
        self._lock = self.table.lock
        """The table's lock, held too while the dispatcher changes a worker's state."""
        self._ever_ready = False
        self.on_never_started: Callable[[str], None] | None = None
        """Called (on the dispatcher thread, with the reason) when every worker is given up and none was ever ready:
        ``python -m synth.server`` then exits non-zero rather than serve with no worker (a server started by
        :func:`create_app` alone keeps answering ``failed`` / 503)."""

    # -- lifecycle ------------------------------------------------------------------------------------------------

    def start(self) -> None:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        sweep_temp_files(self.output_dir)
        for w in self._workers:
            self._spawn(w)
        self._thread = threading.Thread(target=self._run, name="synth-dispatcher", daemon=True)
        self._thread.start()

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
            job = self.table.by_uid(r["uid"])
            if job is None or job.state != JobState.running or not self.table.holds(job):
                unlink_below(self.output_dir, r.get("tmp_path"))  # cancelled while running: never replaces another's
                continue
            job.run_s, job.paint_s, job.finished_at = r.get("run_s"), r.get("paint_s"), now
            if r["ok"]:
                try:
                    job.output_identity = publish(
                        self.output_dir, r["tmp_path"], r["result"]["output_path"], r.get("tmp_identity")
                    )
                except OSError as e:
                    unlink_below(self.output_dir, r.get("tmp_path"))
                    job.error = f"could not publish the output {r['result']['output_path']!r}: {e}"
                    self.table.set_state(job, JobState.failed)
                else:
                    job.result = r["result"]
                    self.table.set_state(job, JobState.done)
            else:
                job.error = r["error"]
                self.table.set_state(job, JobState.failed)
            job.inp = None  # drop decoded bytes
        w.busy, w.busy_ids, w.temps, w.deadline = [], [], [], None

    def _on_exit(self, w: _Worker, reason: str) -> None:
        """A worker process ended: retry or fail its jobs, then schedule a restart (or give the worker up)."""
        now = time.time()
        with self._lock:
            was_ready = w.ready
            for uid in w.busy:
                job = self.table.by_uid(uid)
                if job is None or job.state != JobState.running:
                    continue
                if job.attempts >= self.cfg.max_attempts:
                    job.error = (
                        f"worker {w.index} ({w.device}) {reason} while running this job, on attempt "
                        f"{job.attempts} of max_attempts = {self.cfg.max_attempts}; giving up"
                    )
                    job.finished_at = now
                    job.inp = None
                    self.table.set_state(job, JobState.failed)
                else:
                    self.table.requeue_alone(job)
            for tmp in w.temps:  # a worker killed mid-write leaves a partial temp file
                unlink_below(self.output_dir, tmp)
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
        self.table.fail_queued(msg)
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

    def _dispatch(self) -> None:
        plans = []
        with self._lock:
            now = time.time()
            for w in self._workers:
                if not (w.proc is not None and w.ready and not w.busy and self.table.waiting()):
                    continue
                if self.table.hold_for_batch(now):
                    break
                batch = self.table.next_batch()
                if not batch:
                    continue
                items = [self.table.start(job, now) for job in batch]
                w.busy, w.busy_ids = [j.uid for j in batch], [j.key for j in batch]
                w.temps = [it["tmp_path"] for it in items]
                w.deadline = now + self.cfg.job_timeout_s * len(batch)
                plans.append((w, items))
        for w, items in plans:
            try:
                w.conn.send(items)
            except (OSError, ValueError):
                self._kill(w, "could not be reached")

    # -- the HTTP handlers' operations ----------------------------------------------------------------------------

    def lookup(self, client: str, job_id: str, fingerprint: str) -> JobStatus | None:
        """The client's existing job for an idempotent resubmission, None if new; 409 when the body differs."""
        return self.table.lookup(client, job_id, fingerprint)

    def submit(self, client: str, req: JobRequest, fingerprint: str, inp: PreparedInput) -> tuple[JobStatus, bool]:
        """Queue the job (503 when no worker can start); an identical one that raced it is answered as it is."""
        with self._lock:
            existing = self.table.existing(client, req, fingerprint)
            if existing is not None:
                return existing, False
            if self._workers and all(w.given_up for w in self._workers):
                raise ApiError(503, f"no worker can start, so no job can run: {self._workers[0].error}")
            status = self.table.add(client, req, fingerprint, inp)
        self._wake()
        return status, True

    def get(self, client: str, job_id: str, include_image: bool = False) -> JobStatus:
        return self.table.get(client, job_id, include_image)

    def open_output(self, client: str, job_id: str):
        """The job's output PNG, opened (:meth:`synth.job_table.JobTable.open_output`)."""
        return self.table.open_output(client, job_id)

    def list(self, client: str | None, states: list[JobState] | None, since: int, limit: int) -> JobList:
        """The jobs of ``client`` (None: every client's, the admin's view) that changed after cursor ``since``."""
        return self.table.list(client, states, since, limit)

    def ack(self, client: str, job_id: str) -> Ack:
        return self.table.ack(client, job_id)

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
                queue_depth=self.table.queued(),
                queue_capacity=self.cfg.max_queued,
                counts=self.table.counts(client),
                uptime_s=time.time() - self._started_at,
            )
