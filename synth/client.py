"""Clients of the data server: a thin synchronous :class:`SynthClient` that mirrors the API, an
:class:`AsyncSubmitter` that keeps all HTTP off the training thread, and :class:`LocalServer`, which starts a
server subprocess when no URL is configured.

Typical use in a training callback::

    with LocalServer(roots=[data_root], output_dir=run_dir / "synth") as server:   # or a URL + token from config
        sub = AsyncSubmitter(server.client())
        sub.submit(JobRequest(job_id=f"{sid}@e{epoch}", sample_id=sid, image=ImageRef(path=p), boxes=b,
                              description=text, seed=seed))                        # returns at once
        ...
        for status in sub.pop_finished():                                          # at the epoch boundary
            if status.state == "done": pool.swap(status.sample_id, status.result.output_path, status.result.boxes)
        sub.ack([s.job_id for s in finished])                                      # the server may forget them
        sub.close()

Only httpx and pydantic are used (no torch), so a trainer on another node needs nothing else.
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import random
import re
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from core.processes import pid_alive
from synth.api import (
    ADMIN_CLIENT,
    Ack,
    Health,
    JobList,
    JobRequest,
    JobState,
    JobStatus,
    Timings,
    client_token,
    is_client_token,
)

log = logging.getLogger("synth.client")

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "configs" / "synth" / "procedural.yaml"
FINISHED = (JobState.done, JobState.failed)


TRANSIENT_STATUS = frozenset({429, 502, 503, 504})
"""Answers worth retrying: queue full (429), and a gateway or the server being briefly unavailable (502, 503, 504).
A 500 is not among them: the same request gives the same bug, so retrying it only delays the jobs behind it."""


class SynthError(Exception):
    """An error answer from the server (4xx, or 5xx after the retries): status code, message, per-field errors."""

    def __init__(self, status_code: int, detail: str, errors: list[dict] | None = None):
        super().__init__(f"{status_code}: {detail}")
        self.status_code, self.detail, self.errors = status_code, detail, errors

    retry_after: float = 0.0
    """The server's ``Retry-After`` (seconds), if it sent one."""

    @property
    def transient(self) -> bool:
        return self.status_code in TRANSIENT_STATUS


class SynthClient:
    """Synchronous client mirroring the server's endpoints.

    Transient failures (connection errors and the answers in :data:`TRANSIENT_STATUS`: 429, 502, 503, 504) are
    retried with exponential backoff and jitter (``retries`` times, starting at ``backoff`` seconds, at most
    ``max_backoff``, honouring ``Retry-After``); every call is safe to repeat because jobs are idempotent by
    ``job_id``. Any other error answer (4xx, 500, ...) raises :class:`SynthError` at once.

    Args:
        url: the server's base URL, e.g. ``http://127.0.0.1:8765``.
        token: bearer token: a client token (``python -m synth.server token CLIENT_ID``), or the server's secret
            (``$SYNTH_TOKEN``: the admin, unless ``client_id`` is given); None sends no header.
        client_id: act as this client: ``token`` is then the server's secret, and the client presents the client
            token made from it (``synth.api.client_token``), so it sees only its own jobs. A trainer passes the id
            of its run, so a resumed run finds its pending jobs again.
        timeout: seconds per HTTP request.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        timeout: float = 30.0,
        retries: int = 5,
        backoff: float = 0.2,
        max_backoff: float = 5.0,
        client_id: str | None = None,
    ):
        if client_id is not None:
            if not token:
                raise ValueError(f"SynthClient client_id={client_id!r} needs the server's secret as its token")
            if is_client_token(token) and token.rpartition(".")[0] != client_id:
                raise ValueError(f"SynthClient: the token is client {token.rpartition('.')[0]!r}'s, not {client_id!r}")
            token = token if is_client_token(token) else client_token(token, client_id)
        self.client_id = client_id
        self.url = url.rstrip("/")
        self.retries, self.backoff, self.max_backoff = retries, backoff, max_backoff
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        self._http = httpx.Client(base_url=self.url, headers=headers, timeout=timeout)

    # -- plumbing -------------------------------------------------------------------------------------------------

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> SynthClient:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _request(self, method: str, path: str, retries: int | None = None, **kwargs: Any) -> httpx.Response:
        retries = self.retries if retries is None else retries
        delay = self.backoff
        for attempt in range(retries + 1):
            try:
                resp = self._http.request(method, path, **kwargs)
            except httpx.TransportError as e:
                if attempt == retries:
                    raise ConnectionError(f"{method} {self.url}{path} failed after {attempt + 1} tries: {e!r}") from e
            else:
                retryable = resp.status_code in TRANSIENT_STATUS
                if not retryable or attempt == retries:
                    if resp.status_code >= 400:
                        raise _error(resp)
                    return resp
                with contextlib.suppress(ValueError):
                    delay = max(delay, float(resp.headers.get("retry-after", 0)))
            time.sleep(min(self.max_backoff, delay) * (0.5 + random.random() / 2))
            delay = min(self.max_backoff, delay * 2)
        raise AssertionError("unreachable")

    # -- the API --------------------------------------------------------------------------------------------------

    def submit(self, request: JobRequest | Mapping[str, Any], retries: int | None = None) -> JobStatus:
        """``POST /jobs``: queue a job (or get the existing one with this ``job_id``)."""
        if isinstance(request, JobRequest):
            content = request.model_dump_json(exclude_none=True)
        else:
            content = JobRequest.model_validate(request).model_dump_json(exclude_none=True)
        headers = {"Content-Type": "application/json"}
        resp = self._request("POST", "/jobs", retries=retries, content=content, headers=headers)
        return JobStatus.model_validate_json(resp.content)

    def get(self, job_id: str, include_image: bool = False) -> JobStatus:
        """``GET /jobs/{job_id}``; ``include_image`` adds the output PNG as base64 (``result.image_b64``)."""
        params = {"include_image": "true"} if include_image else None
        return JobStatus.model_validate_json(self._request("GET", f"/jobs/{job_id}", params=params).content)

    def image(self, job_id: str) -> bytes:
        """``GET /jobs/{job_id}/image``: the output PNG's bytes (for trainers without the shared filesystem)."""
        return self._request("GET", f"/jobs/{job_id}/image").content

    def list(
        self, state: JobState | str | Iterable[JobState | str] | None = None, since: int = 0, limit: int = 1000
    ) -> JobList:
        """``GET /jobs``: jobs that changed after cursor ``since``, optionally only in the given state(s)."""
        if isinstance(state, (str, JobState)):
            state = [state]
        params: list[tuple[str, Any]] = [("since", since), ("limit", limit)]
        params += [("state", JobState(s).value) for s in state or []]
        return JobList.model_validate_json(self._request("GET", "/jobs", params=params).content)

    def ack(self, job_id: str) -> Ack:
        """``POST /jobs/{job_id}/ack``: the client has the result; the server forgets the job (not the file)."""
        return Ack.model_validate_json(self._request("POST", f"/jobs/{job_id}/ack").content)

    def health(self) -> Health:
        return Health.model_validate_json(self._request("GET", "/health").content)

    def wait(self, job_ids: Iterable[str], timeout: float = 600.0, poll_interval: float = 0.1) -> dict[str, JobStatus]:
        """Block until every job is done or failed (the sync mode); raises TimeoutError naming the ones still open.

        Polls ``GET /jobs?state=done&state=failed&since=<cursor>``, so each poll costs only what changed.
        """
        wanted = set(job_ids)
        found: dict[str, JobStatus] = {}
        cursor, server_id = 0, None
        deadline = time.monotonic() + timeout
        while True:
            page = self.list(FINISHED, since=cursor, limit=10000)
            if server_id is not None and page.server_id != server_id:
                log.warning(
                    "synth server restarted (server_id %s -> %s): unfinished jobs are gone; resubmit them",
                    server_id,
                    page.server_id,
                )
                cursor, server_id = 0, page.server_id
                continue
            cursor, server_id = page.cursor, page.server_id
            for s in page.jobs:
                if s.job_id in wanted:
                    found[s.job_id] = s
            if len(found) == len(wanted):
                return found
            if len(page.jobs) == 10000:
                continue  # more to read right away
            if time.monotonic() > deadline:
                missing = sorted(wanted - set(found))
                raise TimeoutError(f"{len(missing)} jobs not finished after {timeout} s: {missing[:10]}")
            time.sleep(poll_interval)


def _error(resp: httpx.Response) -> SynthError:
    try:
        body = resp.json()
        err = SynthError(resp.status_code, str(body.get("detail", body)), body.get("errors"))
    except (ValueError, AttributeError):
        err = SynthError(resp.status_code, resp.text[:500])
    with contextlib.suppress(ValueError, TypeError):
        err.retry_after = float(resp.headers.get("retry-after", 0))
    return err


@dataclass
class _Outgoing:
    """A request waiting in the submitter: how often sending it failed transiently, and when to try again."""

    request: JobRequest
    attempts: int = 0
    not_before: float = 0.0


class AsyncSubmitter:
    """Keeps HTTP off the training thread: ``submit`` only enqueues; a daemon thread posts, polls and acknowledges.

    The thread sends queued requests in order, polls ``GET /jobs?state=done&state=failed&since=<cursor>`` every
    ``poll_interval`` seconds for the jobs it submitted, and sends queued acknowledgements. Finished statuses wait in
    a thread-safe buffer until :meth:`pop_finished`; every job submitted comes back exactly once, done or failed.

    Retry policy (docs/data_server.md): only transient failures are retried: connection errors and 429 / 502 / 503 /
    504 answers. Such a request waits ``backoff`` seconds (doubling up to ``max_backoff``, with jitter, at least the
    server's ``Retry-After``), goes to the back of the queue, and the round stops (the server is struggling); after
    ``max_retries`` retries it is given up. Any other error answer (a 4xx, a 500) is final at once. A request given up
    or refused comes back as a failed status with the reason (the sample keeps its image) and is counted in
    ``stats()["rejected"]``; it is never re-queued ahead of the others, so one bad job cannot stall the rest.

    Args:
        client: a :class:`SynthClient` (used only by the background thread from now on).
        poll_interval: seconds between polls for finished jobs.
        auto_ack: acknowledge each job as soon as :meth:`pop_finished` hands it out.
        max_retries: transient failures a request may meet before it is given up.
        backoff: seconds before the first retry of a request.
        max_backoff: longest wait between two tries of a request.
    """

    def __init__(
        self,
        client: SynthClient,
        poll_interval: float = 1.0,
        auto_ack: bool = False,
        max_retries: int = 20,
        backoff: float = 0.2,
        max_backoff: float = 5.0,
    ):
        if max_retries < 0:
            raise ValueError(f"AsyncSubmitter max_retries must be >= 0, got {max_retries}")
        self.client, self.poll_interval, self.auto_ack = client, poll_interval, auto_ack
        self.max_retries, self.backoff, self.max_backoff = max_retries, backoff, max_backoff
        self._outbox: queue.SimpleQueue[JobRequest | None] = queue.SimpleQueue()
        self._acks: queue.SimpleQueue[str] = queue.SimpleQueue()
        self._lock = threading.Condition()
        self._in_flight: dict[str, JobRequest] = {}  # job_id -> request, kept to resubmit after a server restart
        self._finished: dict[str, JobStatus] = {}
        self._n_submitted = self._n_unsent = self._n_rejected = self._n_retries = 0
        self.last_error: str | None = None
        self._cursor = 0
        self._server_id: str | None = None
        self._resubmit: list[JobRequest] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="synth-submitter", daemon=True)
        self._thread.start()

    def submit(self, request: JobRequest) -> None:
        """Queue a job for the server; returns at once."""
        with self._lock:
            self._n_unsent += 1
        self._outbox.put(request)

    def ack(self, job_ids: Iterable[str]) -> None:
        """Queue acknowledgements (the server then forgets those jobs); returns at once."""
        for j in job_ids:
            self._acks.put(j)

    def pop_finished(self) -> list[JobStatus]:
        """Finished (done or failed) jobs seen since the last call, in the order they finished."""
        with self._lock:
            out = list(self._finished.values())
            self._finished.clear()
        if self.auto_ack:
            self.ack(s.job_id for s in out)
        return out

    def wait(self, job_ids: Iterable[str], timeout: float = 600.0) -> None:
        """Block until the given jobs are finished (the sync mode); they stay in the buffer for :meth:`pop_finished`."""
        wanted = set(job_ids)
        deadline = time.monotonic() + timeout
        with self._lock:
            while not wanted <= set(self._finished):
                left = deadline - time.monotonic()
                if left <= 0:
                    missing = sorted(wanted - set(self._finished))
                    raise TimeoutError(f"{len(missing)} jobs not finished after {timeout} s: {missing[:10]}")
                self._lock.wait(min(left, 0.5))

    def stats(self) -> dict[str, Any]:
        """Counts for logging: ``unsent`` (queued here), ``in_flight`` (on the server), ``finished`` (not yet popped),
        ``rejected`` (given up or refused, reported as failed), ``retries`` (transient failures met)."""
        with self._lock:
            return dict(
                submitted=self._n_submitted,
                unsent=self._n_unsent,
                in_flight=len(self._in_flight),
                finished=len(self._finished),
                rejected=self._n_rejected,
                retries=self._n_retries,
                last_error=self.last_error,
            )

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread after it sends what is queued (up to ``timeout`` seconds), then close the client."""
        self._outbox.put(None)
        self._stop.set()
        self._thread.join(timeout)
        self.client.close()

    # -- background thread --------------------------------------------------------------------------------------

    def _run(self) -> None:
        with contextlib.suppress(SynthError, ConnectionError, httpx.HTTPError):
            self._server_id = self.client.health().server_id
        pending: list[_Outgoing] = []
        next_poll = 0.0
        stopping = False
        while True:
            try:
                item = self._outbox.get(timeout=0.05 if not pending else 0.0)
                while True:
                    if item is None:
                        stopping = True
                    else:
                        pending.append(_Outgoing(item))
                    item = self._outbox.get_nowait()
            except queue.Empty:
                pass
            if self._resubmit:
                pending, self._resubmit = [_Outgoing(r) for r in self._resubmit] + pending, []
            pending = self._send(pending)
            self._send_acks()
            now = time.monotonic()
            if now >= next_poll or stopping:
                self._poll()
                next_poll = now + self.poll_interval
            if stopping and (not pending or self._stop.is_set()):
                return  # close() asked: what could not be sent now is the caller's to resubmit (idempotent ids)
            if pending:
                wake = min(o.not_before for o in pending)
                time.sleep(min(self.poll_interval, 0.5, max(0.01, wake - time.monotonic())))

    def _delay(self, attempts: int, retry_after: float = 0.0) -> float:
        base = min(self.max_backoff, self.backoff * 2 ** (attempts - 1))
        return max(retry_after, base * (0.5 + random.random() / 2))

    def _send(self, pending: list[_Outgoing]) -> list[_Outgoing]:
        """Send what is due, in order; returns what is left (a transient failure ends the round)."""
        now = time.monotonic()
        for i, out in enumerate(pending):
            if out.not_before > now:
                continue
            req = out.request
            try:
                status = self.client.submit(req, retries=0)
            except SynthError as e:
                if not e.transient:
                    self._reject(req, f"refused by the server: {e}")
                    pending[i] = None
                    continue
                error, retry_after = str(e), e.retry_after
            except (ConnectionError, httpx.HTTPError) as e:
                error, retry_after = f"server unreachable: {e}", 0.0
            else:
                pending[i] = None
                with self._lock:
                    self._n_unsent -= 1
                    self._n_submitted += 1
                    if status.state in FINISHED:
                        self._finished[status.job_id] = status
                        self._lock.notify_all()
                    else:
                        self._in_flight[status.job_id] = req
                continue
            # a transient failure: this request waits and goes to the back; the others keep their order
            out.attempts += 1
            self._n_retries += 1
            self.last_error = f"submit {req.job_id}: {error}"
            rest = [o for o in pending if o is not None and o is not out]
            if out.attempts > self.max_retries:
                self._reject(req, f"gave up after {out.attempts} attempts (max_retries = {self.max_retries}): {error}")
                return rest
            out.not_before = time.monotonic() + self._delay(out.attempts, retry_after)
            log.warning(
                "synth submit %s failed (%s); retry %d of %d", req.job_id, error, out.attempts, self.max_retries
            )
            return rest + [out]
        return [o for o in pending if o is not None]

    def _reject(self, req: JobRequest, error: str) -> None:
        log.warning("synth job %s dropped: %s", req.job_id, error)
        status = JobStatus(
            job_id=req.job_id,
            client=self.client.client_id or ADMIN_CLIENT,
            sample_id=req.sample_id,
            state=JobState.failed,
            error=error,
            timings=Timings(created_at=time.time()),
        )
        with self._lock:
            self._n_unsent -= 1
            self._n_rejected += 1
            self._finished[req.job_id] = status
            self.last_error = error
            self._lock.notify_all()

    def _send_acks(self) -> None:
        while True:
            try:
                job_id = self._acks.get_nowait()
            except queue.Empty:
                return
            try:
                self.client.ack(job_id)
            except SynthError as e:
                self.last_error = f"ack {job_id}: {e}"
                if e.transient:
                    self._acks.put(job_id)
                    return
                log.warning("synth ack of %s refused, not retried: %s", job_id, e)  # the server keeps a result
            except (ConnectionError, httpx.HTTPError) as e:
                self.last_error = f"ack {job_id}: {e}"
                self._acks.put(job_id)
                return

    def _poll(self) -> None:
        with self._lock:
            if not self._in_flight:
                return
        try:
            page = self.client.list(FINISHED, since=self._cursor, limit=10000)
        except (SynthError, ConnectionError, httpx.HTTPError) as e:
            self.last_error = f"poll: {e}"
            return
        if self._server_id is not None and page.server_id != self._server_id:
            # The server restarted and forgot its jobs: send ours again (idempotent, so nothing is done twice).
            with self._lock:
                log.warning("synth server restarted: resubmitting %d in-flight jobs", len(self._in_flight))
                self._resubmit = list(self._in_flight.values())
                self._n_unsent += len(self._resubmit)
                self._n_submitted -= len(self._resubmit)
                self._in_flight.clear()
            self._server_id, self._cursor = page.server_id, 0
            return
        self._server_id, self._cursor = page.server_id, page.cursor
        with self._lock:
            for s in page.jobs:
                if self._in_flight.pop(s.job_id, None) is not None:
                    self._finished[s.job_id] = s
            self._lock.notify_all()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


LOCAL_DIR_PREFIX = "synth-local-"
"""``<temp folder>/synth-local-<pid>-<random>``: a `LocalServer`'s folder (its port file, and its log unless
``log_path`` is given), owned by process ``pid``."""
_LOCAL_DIR = re.compile(rf"^{LOCAL_DIR_PREFIX}(?P<pid>[0-9]+)-")
_own_local_dirs: set[str] = set()  # this process's running servers' folders


def remove_stale_local_dirs(parent: str | os.PathLike | None = None) -> list[Path]:
    """Remove the `LocalServer` folders in ``parent`` (default: the system temp folder) whose owner is gone: a killed
    trainer cannot remove its own. The owner is the pid in the name; a folder of this pid that none of this process's
    servers uses is stale too (a container restarted under the same pid). Folders named before the pid was (no pid)
    are left alone: their owner cannot be told."""
    root = Path(parent or tempfile.gettempdir())
    removed = []
    with contextlib.suppress(OSError):
        for p in sorted(root.iterdir()):
            m = _LOCAL_DIR.match(p.name)
            if m is None or str(p) in _own_local_dirs or not p.is_dir() or p.is_symlink():
                continue
            pid = int(m["pid"])
            if pid != os.getpid() and pid_alive(pid):
                continue
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


class LocalServer:
    """Start ``python -m synth.server`` as a subprocess on a free loopback port with a fresh token.

    Waits until ``/health`` reports every worker ready; stops the server (SIGTERM, then SIGKILL) on exit. The server
    also exits by itself if this process dies (``--parent-pid``). Its output goes to ``log_path`` (a temp file by
    default), which error messages quote. The temp folder (``synth-local-<pid>-*``) is removed on stop; one that a
    killed process left is removed by the next `LocalServer` start on the machine (`remove_stale_local_dirs`).

    Args:
        config: server YAML (default: the procedural painter, ``configs/synth/procedural.yaml``).
        roots: directories the server may read images from (override the config's).
        output_dir: where results go (overrides the config's).
        overrides: more ``key: value`` config overrides (dotted keys allowed, e.g. ``{"painter.delay_s": 0.5}``).
        startup_timeout: seconds to wait for the workers to be ready.
        port: TCP port (0, the default, picks a free one).
        token: bearer token (default: a fresh random one).
    """

    def __init__(
        self,
        config: str | os.PathLike = DEFAULT_CONFIG,
        roots: Iterable[str | os.PathLike] | None = None,
        output_dir: str | os.PathLike | None = None,
        overrides: Mapping[str, Any] | None = None,
        startup_timeout: float = 120.0,
        log_path: str | os.PathLike | None = None,
        env: Mapping[str, str] | None = None,
        port: int = 0,
        token: str | None = None,
    ):
        self.config = Path(config)
        if not self.config.is_file() and (REPO_ROOT / self.config).is_file():
            self.config = REPO_ROOT / self.config
        self.roots, self.output_dir = roots, output_dir
        self.overrides = dict(overrides or {})
        self.startup_timeout, self.env = startup_timeout, dict(env or {})
        self.log_path = Path(log_path) if log_path else None
        self.token = token or secrets.token_urlsafe(32)
        self.requested_port = port
        self.proc: subprocess.Popen | None = None
        self.url: str | None = None
        self.port: int | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self._log = None

    def __enter__(self) -> LocalServer:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def client(self, **kwargs: Any) -> SynthClient:
        if self.url is None:
            raise RuntimeError("LocalServer is not running: call start() or use it as a context manager")
        return SynthClient(self.url, self.token, **kwargs)  # client_id=... makes it that client, else the admin

    def _args(self, port_file: str) -> list[str]:
        import json

        sets = dict(self.overrides)
        if self.roots is not None:
            sets["roots"] = [str(Path(r).resolve()) for r in self.roots]
        if self.output_dir is not None:
            sets["output_dir"] = str(Path(self.output_dir).resolve())
        args = [
            sys.executable,
            "-m",
            "synth.server",
            "--config",
            str(self.config.resolve()),
            "--port",
            str(self.requested_port),
            "--host",
            "127.0.0.1",
            "--port-file",
            port_file,
            "--parent-pid",
            str(os.getpid()),
        ]
        for k, v in sets.items():
            args += ["--set", f"{k}={json.dumps(v)}"]  # JSON is YAML
        return args

    def log_tail(self, n: int = 40) -> str:
        if self.log_path is None or not self.log_path.exists():
            return ""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-n:])

    def start(self) -> None:
        if stale := remove_stale_local_dirs():
            log.info(
                "removed %d synth-local folder(s) that killed processes left: %s", len(stale), " ".join(map(str, stale))
            )
        self._tmp = tempfile.TemporaryDirectory(prefix=f"{LOCAL_DIR_PREFIX}{os.getpid()}-")
        _own_local_dirs.add(self._tmp.name)
        port_file = os.path.join(self._tmp.name, "port")
        if self.log_path is None:
            self.log_path = Path(self._tmp.name) / "server.log"
        self._log = open(self.log_path, "ab")
        env = {**os.environ, **self.env, "SYNTH_TOKEN": self.token, "PYTHONUNBUFFERED": "1"}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH")) if p)
        self.proc = subprocess.Popen(
            self._args(port_file),
            env=env,
            cwd=str(REPO_ROOT),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + self.startup_timeout
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"synth server exited with code {self.proc.returncode}:\n{self.log_tail()}")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"synth server not ready after {self.startup_timeout} s:\n{self.log_tail()}")
                if self.url is None and os.path.exists(port_file):
                    self.port = int(Path(port_file).read_text().strip())
                    self.url = f"http://127.0.0.1:{self.port}"
                if self.url is not None:
                    with contextlib.suppress(ConnectionError, SynthError, httpx.HTTPError):
                        with SynthClient(self.url, self.token, timeout=5.0, retries=0) as c:
                            h = c.health()
                        if h.status == "ok":
                            return
                        if h.status == "failed" or all(w.error and not w.ready for w in h.workers):
                            errors = "; ".join(w.error or "" for w in h.workers)
                            raise RuntimeError(f"synth server workers cannot start: {errors}\n{self.log_tail()}")
                time.sleep(0.1)
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout: float = 15.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None
        if self._tmp is not None:
            if self.log_path is not None and Path(self._tmp.name) in self.log_path.parents:
                self.log_path = None  # it goes with the temp dir
            self._tmp.cleanup()
            _own_local_dirs.discard(self._tmp.name)
            self._tmp = None
        self.url = None
