"""Reliability of the data server (issue #13): inputs that used to answer 500, cancel semantics, temp-file sweeps,
the client's retry policy. Real ``python -m synth.server`` subprocesses on 127.0.0.1 and real workers throughout.
"""

from __future__ import annotations

import hashlib
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from synth.api import ImageRef, JobRequest, JobState
from synth.client import AsyncSubmitter, LocalServer, SynthClient, SynthError

DESCRIPTION = "a striped blue and white background with many small green triangles"


def make_image(path: Path, w: int = 48, h: int = 40, seed: int = 0) -> list[list[float]]:
    rng = np.random.default_rng(seed)
    Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(path)
    return [[4.0, 5.0, 20.0, 22.0]]


def sha(path: Path | str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def request(job_id: str, path: Path, boxes, seed: int = 0, description: str = DESCRIPTION, **kw) -> JobRequest:
    return JobRequest(
        job_id=job_id,
        sample_id=job_id,
        image=ImageRef(path=str(path)),
        boxes=boxes,
        description=description,
        seed=seed,
        **kw,
    )


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("rel-data")
    items = []
    for i in range(4):
        p = root / f"{i}.png"
        items.append((p, make_image(p, seed=i)))
    return {"root": root, "items": items}


@pytest.fixture(scope="module")
def server(data, tmp_path_factory):
    out = tmp_path_factory.mktemp("rel-out")
    with LocalServer(roots=[data["root"]], output_dir=out, startup_timeout=60) as s:
        yield s


@pytest.fixture()
def http(server):
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}, timeout=20) as c:
        yield c


# --- inputs that used to answer 500 ----------------------------------------------------------------------------------


def test_hostile_image_paths_get_4xx_not_500(http, data):
    p, b = data["items"][0]
    good = request("path-0", p, b).model_dump(mode="json", exclude_none=True)
    cases = [
        (str(data["root"] / "0.png\x00.txt"), 422, "NUL"),  # os.path.realpath raised ValueError
        (str(data["root"] / ("x" * 300 + ".png")), 400, "File name too long"),  # is_file raised ENAMETOOLONG
        (str(data["root"] / ("d" * 300) / "0.png"), 400, "File name too long"),
        (str(data["root"]), 400, "not a file"),
    ]
    for path, code, text in cases:
        r = http.post("/jobs", json={**good, "image": {"path": path}})
        assert r.status_code == code, (path[:60], r.status_code, r.text)
        assert text in r.json()["detail"], r.text
    assert http.get("/health").json()["status"] == "ok"


def test_image_of_a_job_whose_output_was_removed_is_410(server, data):
    p, b = data["items"][1]
    with server.client(timeout=20) as c:
        c.submit(request("gone-1", p, b))
        st = c.wait(["gone-1"], timeout=30)["gone-1"]
        os.unlink(st.result.output_path)
        for call in (lambda: c.image("gone-1"), lambda: c.get("gone-1", include_image=True)):
            with pytest.raises(SynthError) as e:
                call()
            assert e.value.status_code == 410 and "no longer on disk" in e.value.detail


# --- cancel semantics: a cancelled job's late output never replaces a newer job's ---------------------------------


def busy_jobs(c, timeout: float = 30.0, want: str | None = None) -> list[str]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        busy = [j for w in c.health().workers for j in w.busy]
        if want is None or want in busy:
            return busy
        time.sleep(0.03)
    raise TimeoutError(f"{want} never ran")


def test_a_cancelled_running_job_never_overwrites_the_newer_job_with_its_id(data, tmp_path):
    p, b = data["items"][2]
    painter = {"name": "tests.slow_painter:SeedDelayPainter", "delays": {"7": 2.5}}
    out = tmp_path / "out"
    with LocalServer(
        roots=[data["root"]], output_dir=out, overrides={"devices": ["cpu", "cpu"], "painter": painter}
    ) as s:
        with s.client(timeout=20) as c:
            c.submit(request("stale-1", p, b, seed=7))  # the old body: slow
            busy_jobs(c, want="stale-1")
            t_old = time.monotonic()
            ack = c.ack("stale-1")
            assert ack.acknowledged and ack.cancelled
            c.submit(request("stale-1", p, b, seed=8))  # a new body under the same id, on the other worker
            new = c.wait(["stale-1"], timeout=30)["stale-1"]
            assert new.state == JobState.done
            new_sha = sha(new.result.output_path)
            time.sleep(max(0.0, t_old + 2.5 + 1.0 - time.monotonic()))  # the cancelled job has finished painting
            assert not any(w.busy for w in c.health().workers)
            assert sha(new.result.output_path) == new_sha, "the cancelled job's late output replaced the new one"
            assert c.get("stale-1").state == JobState.done
    assert sorted(os.listdir(out / "admin")) == ["stale-1.png"]  # the cancelled job's temp file is gone too


def test_temp_files_of_a_killed_run_are_swept_at_start_up(data, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    stale = [f".a.png.{'0' * 32}.tmp", f".s0@e1-1234abcd.png.{'f1' * 16}.tmp"]
    kept = ["a.png", "notes.tmp", ".hidden.png"]
    for name in stale + kept:
        (out / name).write_bytes(b"partial")
    with LocalServer(roots=[data["root"]], output_dir=out):
        pass
    assert sorted(os.listdir(out)) == sorted(kept)


# --- the client's retry policy ---------------------------------------------------------------------------------------


class FaultProxy:
    """A real loopback HTTP server in front of the data server that answers chosen requests with an error itself.

    ``rules``: ``(marker, status, times)``: a request whose body holds ``marker`` gets ``status`` (``times`` times;
    None: always); everything else is forwarded.
    """

    def __init__(self, upstream: str, rules: list[tuple[str, int, int | None]]):
        self.rules = [[m, s, t] for m, s, t in rules]
        self.hits: list[tuple[str, int]] = []
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # quiet
                pass

            def _handle(self):
                n = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(n) if n else b""
                for rule in proxy.rules:
                    marker, status, times = rule
                    if marker.encode() in body and (times is None or times > 0):
                        if times is not None:
                            rule[2] -= 1
                        proxy.hits.append((marker, status))
                        payload = b'{"detail": "injected by the test proxy"}'
                        self.send_response(status)
                        self.send_header("Content-Type", "application/json")
                        self.send_header("Content-Length", str(len(payload)))
                        self.end_headers()
                        self.wfile.write(payload)
                        return
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("authorization", "content-type")}
                r = httpx.request(self.command, upstream + self.path, content=body, headers=headers, timeout=20)
                self.send_response(r.status_code)
                self.send_header("Content-Type", r.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            do_GET = do_POST = do_DELETE = _handle

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self) -> FaultProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_deterministic_500_is_dropped_and_counted_and_never_blocks_the_jobs_behind_it(server, data):
    p, b = data["items"][3]
    with FaultProxy(server.url, [("poison", 500, None), ("flaky", 503, 2), ("always-busy", 503, None)]) as proxy:
        client = SynthClient(proxy.url, server.token, timeout=10)
        sub = AsyncSubmitter(client, poll_interval=0.05, max_retries=3, backoff=0.05, max_backoff=0.2)
        try:
            ids = ["poison-1", "flaky-1", "always-busy-1", "ok-1", "ok-2", "ok-3"]
            for i, j in enumerate(ids):
                sub.submit(request(j, p, b, seed=i))
            sub.wait(ids, timeout=20)
            got = {s.job_id: s for s in sub.pop_finished()}
        finally:
            sub.close(timeout=5)
    assert set(got) == set(ids)  # every job comes back exactly once
    for j in ("flaky-1", "ok-1", "ok-2", "ok-3"):
        assert got[j].state == JobState.done, (j, got[j].error)
    assert got["poison-1"].state == JobState.failed and "500" in got["poison-1"].error
    assert proxy.hits.count(("poison", 500)) == 1  # not retried: a 500 is not transient
    assert got["always-busy-1"].state == JobState.failed and "gave up after 4 attempts" in got["always-busy-1"].error
    assert proxy.hits.count(("always-busy", 503)) == 4  # 1 try + max_retries, then dropped
    stats = sub.stats()
    assert stats["rejected"] == 2 and stats["unsent"] == 0 and stats["in_flight"] == 0


def test_sync_client_retries_only_transient_answers(server):
    with FaultProxy(server.url, [("poison", 500, None), ("flaky", 503, 2)]) as proxy:
        with SynthClient(proxy.url, server.token, timeout=10, retries=3, backoff=0.01) as c:
            with pytest.raises(SynthError) as e:
                c._request("POST", "/jobs", content=b'{"job_id": "poison"}')
            assert e.value.status_code == 500
            assert proxy.hits == [("poison", 500)]
            with pytest.raises(SynthError) as e:  # 503, 503 (retried), then the server's own answer: 422
                c._request(
                    "POST", "/jobs", content=b'{"job_id": "flaky"}', headers={"Content-Type": "application/json"}
                )
            assert e.value.status_code == 422
    assert proxy.hits.count(("flaky", 503)) == 2
