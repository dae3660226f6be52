"""The data server's job table: the jobs it holds, keyed by (client id, ``job_id``), and the queue of those waiting
for a worker (``synth.jobs.JobManager`` runs them).

A client's operations reach only its own jobs (``synth.api``, "Clients and their jobs"); ``client=None`` on
:meth:`JobTable.list` is the admin's view of every client. Every change of a job's state bumps the table's cursor, so
``GET /jobs?since=`` lists what changed. One lock (``JobTable.lock``) guards the table: the HTTP handlers' methods take
it for their short reads and writes; the methods marked "caller holds the lock" are the dispatcher's, called inside
its own critical sections, which cover the workers' state too.
"""

import base64
import collections
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from synth.api import Ack, AuditResult, JobList, JobRequest, JobResult, JobState, JobStatus, Timings
from synth.config import ServerConfig
from synth.inputs import ApiError, PreparedInput, open_output
from synth.outputs import temp_path

log = logging.getLogger("synth.server")

Key = tuple[str, str]
"""A job's key in the table: (client id, job_id)."""


@dataclass
class Job:
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


class JobTable:
    """The jobs held (in the order they last changed) and the queue of uids waiting for a worker."""

    def __init__(self, cfg: ServerConfig, output_dir: Path, server_id: str):
        self.cfg, self.output_dir, self.server_id = cfg, output_dir, server_id
        self.lock = threading.Lock()
        self._jobs: collections.OrderedDict[Key, Job] = collections.OrderedDict()  # ordered by cursor
        self._by_uid: dict[str, Job] = {}
        self._pending: collections.deque[str] = collections.deque()  # uids
        self._counts: collections.Counter[str] = collections.Counter()
        self._cursor = 0

    # -- the dispatcher's side (caller holds the lock) ------------------------------------------------------------

    def by_uid(self, uid: str) -> Job | None:
        return self._by_uid.get(uid)

    def holds(self, job: Job) -> bool:
        """Whether ``job`` is still the table's job of its key (not acknowledged, nor replaced)."""
        return self._jobs.get(job.key) is job

    def set_state(self, job: Job, state: JobState) -> None:
        """Change state and bump the job's cursor."""
        if self._jobs.get(job.key) is job:
            self._counts[job.state.value] -= 1
            self._counts[state.value] += 1
            self._cursor += 1
            job.cursor = self._cursor
            self._jobs.move_to_end(job.key)
        job.state = state

    def requeue_alone(self, job: Job) -> None:
        """Put a job whose worker died back at the head of the queue, to run alone next time."""
        job.solo = True
        self.set_state(job, JobState.queued)
        self._pending.appendleft(job.uid)

    def fail_queued(self, error: str) -> None:
        """Fail every queued job with ``error`` (no worker can run them) and empty the queue."""
        for uid in list(self._pending):
            job = self._by_uid.get(uid)
            if job is not None and job.state == JobState.queued:
                job.error, job.finished_at, job.inp = error, time.time(), None
                self.set_state(job, JobState.failed)
        self._pending.clear()

    def waiting(self) -> bool:
        """Whether the queue holds any uid (some may name jobs acknowledged since)."""
        return bool(self._pending)

    def hold_for_batch(self, now: float) -> bool:
        """True while fewer than ``batch_size`` jobs are queued and the oldest has waited less than the window."""
        window = self.cfg.batch_window_s
        if window <= 0 or len(self._pending) >= self.cfg.batch_size:
            return False
        oldest = self._by_uid.get(self._pending[0])
        return oldest is not None and now - oldest.created_at < window

    def next_batch(self) -> list[Job]:
        """Up to ``batch_size`` queued jobs off the queue's head; a job marked solo runs alone."""
        batch: list[Job] = []
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
        return batch

    def start(self, job: Job, now: float) -> dict[str, Any]:
        """Mark the job running (one more attempt) and return what its worker needs."""
        job.attempts += 1
        job.started_at = now
        self.set_state(job, JobState.running)
        inp = job.inp
        return dict(
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

    def existing(self, client: str, req: JobRequest, fingerprint: str) -> JobStatus | None:
        """The client's job of this ``job_id`` when it raced with an identical submission (409 when the body
        differs); None if there is none."""
        existing = self._jobs.get((client, req.job_id))
        if existing is None:
            return None
        if existing.fingerprint != fingerprint:
            raise ApiError(409, f"job_id {req.job_id!r} already exists with a different request")
        return self._status(existing)

    def add(self, client: str, req: JobRequest, fingerprint: str, inp: PreparedInput) -> JobStatus:
        """Queue a new job (429 when the queue is full or the table holds ``max_jobs_held`` jobs)."""
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
        job = Job(uid=uuid.uuid4().hex, client=client, request=stored, fingerprint=fingerprint, inp=inp)
        self._jobs[job.key] = job
        self._by_uid[job.uid] = job
        self._counts[JobState.queued.value] += 1
        self._cursor += 1
        job.cursor = self._cursor
        self._pending.append(job.uid)
        return self._status(job)

    def queued(self) -> int:
        return self._counts[JobState.queued.value]

    def counts(self, client: str | None) -> dict[str, int]:
        """Jobs held by state: every client's (None, the admin's view), else only ``client``'s."""
        if client is None:
            return {s.value: self._counts[s.value] for s in JobState}
        counts = collections.Counter(job.state.value for (c, _), job in self._jobs.items() if c == client)
        return {s.value: counts[s.value] for s in JobState}

    # -- the HTTP handlers' side (each takes the lock) ------------------------------------------------------------

    def lookup(self, client: str, job_id: str, fingerprint: str) -> JobStatus | None:
        """The client's existing job for an idempotent resubmission, None if new; 409 when the body differs."""
        with self.lock:
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

    def _find(self, client: str, job_id: str) -> Job:
        job = self._jobs.get((client, job_id))
        if job is None:
            raise ApiError(404, f"no job {job_id!r} of client {client!r} (never submitted, or already acknowledged)")
        return job

    def get(self, client: str, job_id: str, include_image: bool = False) -> JobStatus:
        with self.lock:
            job = self._find(client, job_id)
            status = self._status(job)
        if status.result is not None and (include_image or job.request.return_bytes):
            with self.open_output(client, job_id) as fh:
                status.result.image_b64 = base64.b64encode(fh.read()).decode("ascii")
        return status

    def open_output(self, client: str, job_id: str):
        """The job's output PNG, opened: only the file the server published (never a link or a file put in its
        place); 409 before the job is done, 410 once the file is gone or replaced."""
        with self.lock:
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
        with self.lock:
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
        with self.lock:
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

    def _status(self, job: Job) -> JobStatus:
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
