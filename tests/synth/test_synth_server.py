"""The data server for real: ``python -m synth.server`` subprocesses on 127.0.0.1, driven through the client.

Every loop here is bounded (timeouts of tens of seconds at most); the suite takes about 30 s on 2 busy cores.
"""

from __future__ import annotations

import base64
import hashlib
import io
import math
import os
import signal
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image, ImageDraw

from synth.api import ImageRef, JobRequest, JobState
from synth.client import AsyncSubmitter, LocalServer, SynthClient, SynthError, free_port

REPO = Path(__file__).resolve().parents[2]
DESCRIPTIONS = [
    "a striped blue and white background with many small green triangles",
    "a checkered yellow background with few large purple stars",
    "a noisy gray background with no distractors",
    "something the grammar has no word for",
]


def make_image(path: Path, w: int, h: int, i: int) -> list[list[float]]:
    """A textured image (so a repainted background differs) with two objects; returns their boxes."""
    rng = np.random.default_rng(i)
    arr = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
    im = Image.fromarray(arr)
    d = ImageDraw.Draw(im)
    b1 = [5 + i % 7, 6, 5 + i % 7 + w // 3, 6 + h // 3]
    b2 = [w // 2, h // 2, w - 3, h - 2.5]  # a fractional edge: the pixel it half covers is kept
    d.ellipse([b1[0], b1[1], b1[2] - 1, b1[3] - 1], fill=(220, 40, 40))
    d.rectangle([b2[0], b2[1], math.ceil(b2[2]) - 1, math.ceil(b2[3]) - 1], fill=(40, 80, 220))
    im.save(path)
    return [[float(v) for v in b1], [float(v) for v in b2]]


def sha(path: Path | str) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def check_output(status, image_path: Path, boxes, extend: float = 0.0) -> None:
    """Independent of synth.compose: the canvas size, the boxes and the kept pixels, from the file on disk."""
    assert status.state == JobState.done, status.error
    r = status.result
    assert r.audit.passed and r.audit.mismatched_pixels == 0
    src = np.asarray(Image.open(image_path).convert("RGB"))
    h, w = src.shape[:2]
    cw, ch = w + round(w * extend), h + round(h * extend)
    ox, oy = (cw - w) // 2, (ch - h) // 2
    out = np.asarray(Image.open(r.output_path).convert("RGB"))
    assert out.shape == (ch, cw, 3) and (r.width, r.height) == (cw, ch)
    assert r.boxes == [[b[0] + ox, b[1] + oy, b[2] + ox, b[3] + oy] for b in boxes]  # exact, floats included
    for b in boxes:
        c0, r0, c1, r1 = math.floor(b[0]), math.floor(b[1]), math.ceil(b[2]), math.ceil(b[3])
        np.testing.assert_array_equal(out[oy + r0 : oy + r1, ox + c0 : ox + c1], src[r0:r1, c0:c1])
    keep = np.zeros((ch, cw), bool)
    for b in boxes:
        keep[oy + math.floor(b[1]) : oy + math.ceil(b[3]), ox + math.floor(b[0]) : ox + math.ceil(b[2])] = True
    assert (out[~keep] != 0).any()  # something was painted outside the foreground


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("synth-data")
    (root / "images").mkdir()
    items = []
    for i in range(10):
        w, h = (64, 48) if i % 2 else (50, 70)
        p = root / "images" / f"{i}.png"
        items.append((p, make_image(p, w, h, i)))
    return {"root": root, "items": items, "out": tmp_path_factory.mktemp("synth-out")}


@pytest.fixture(scope="module")
def server(data):
    with LocalServer(roots=[data["root"]], output_dir=data["out"], startup_timeout=60) as s:
        yield s


@pytest.fixture()
def client(server):
    with server.client(timeout=20) as c:
        yield c


def request(job_id: str, path: Path, boxes, i: int = 0, **kw) -> JobRequest:
    return JobRequest(
        job_id=job_id,
        sample_id=f"s{i}",
        image=ImageRef(path=str(path)),
        boxes=boxes,
        description=DESCRIPTIONS[i % len(DESCRIPTIONS)],
        seed=i,
        **kw,
    )


def test_procedural_jobs_complete_with_exact_foreground_and_boxes(client, data):
    before = {p: sha(p) for p, _ in data["items"]}
    extends = [0.0, 0.5, 0.25, 1.0]
    reqs = [request(f"proc-{i}", p, b, i, canvas={"extend": extends[i % 4]}) for i, (p, b) in enumerate(data["items"])]
    for r in reqs:
        assert client.submit(r).state in (JobState.queued, JobState.running, JobState.done)
    done = client.wait([r.job_id for r in reqs], timeout=60)
    for i, (p, b) in enumerate(data["items"]):
        check_output(done[f"proc-{i}"], p, b, extends[i % 4])
    assert {p: sha(p) for p, _ in data["items"]} == before  # inputs untouched
    assert not [f for f in os.listdir(data["out"]) if f.endswith(".tmp")]  # no temp files left


def test_resubmitted_job_id_returns_the_same_job(client, data):
    p, b = data["items"][0]
    req = request("idem-1", p, b)
    first = client.submit(req)
    client.wait(["idem-1"], timeout=30)
    again = client.submit(req)
    assert again.job_id == first.job_id and again.state == JobState.done and again.attempts == 1
    assert again.timings.created_at == first.timings.created_at  # the same job, not a new one
    with pytest.raises(SynthError) as e:
        client.submit(req.model_copy(update={"seed": 99}))
    assert e.value.status_code == 409 and "different request" in e.value.detail


def test_bad_requests_get_clear_4xx_and_the_server_keeps_serving(server, client, data, tmp_path):
    p, b = data["items"][1]
    good = request("bad-0", p, b).model_dump(mode="json", exclude_none=True)
    outside = tmp_path / "outside.png"
    Image.new("RGB", (8, 8)).save(outside)
    cases = [
        ({**good, "image": {"path": str(outside)}}, 403, "outside the server's roots"),
        ({**good, "image": {"path": "images/../../../etc/passwd"}}, 403, "outside the server's roots"),
        ({**good, "image": {"path": str(data["root"] / "missing.png")}}, 400, "does not exist"),
        ({**good, "boxes": [[10, 10, 10, 20]]}, 422, "is empty"),
        (
            {**good, "boxes": [[10, 10, 20, 20], [0, 0, 500, 20]]},
            422,
            "boxes[1] = [0.0, 0.0, 500.0, 20.0] lies outside",
        ),
        ({**good, "boxes": []}, 422, "boxes"),
        ({k: v for k, v in good.items() if k != "job_id"}, 422, "job_id"),
        ({**good, "canvas": {"width": 10}}, 422, "canvas.width"),
        ({**good, "image": {"data_b64": "not base64!"}}, 422, "image.data_b64"),
        ({**good, "image": {"data_b64": base64.b64encode(b"not an image").decode()}}, 422, "not a readable image"),
    ]
    http = httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}, timeout=20)
    for body, code, text in cases:
        r = http.post("/jobs", json=body)
        assert r.status_code == code, (body, r.text)
        assert text in r.json()["detail"], r.text
    r = http.post("/jobs", content=b'{"job_id": "x", ', headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["detail"]
    r = http.post("/jobs", content=b"x" * (33 * 1024 * 1024), headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and "max_request_bytes" in r.json()["detail"]
    r = http.get("/jobs", params={"state": "finished"})
    assert r.status_code == 422 and "state" in r.json()["detail"]
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": server.token}):
        r = httpx.post(f"{server.url}/jobs", json=good, headers=headers)
        assert r.status_code == 401 and "bearer token" in r.json()["detail"]
        assert httpx.get(f"{server.url}/health", headers=headers).status_code == 401
    assert http.get("/jobs/nope").status_code == 404
    http.close()
    # still serving
    assert client.health().status == "ok"
    assert client.submit(JobRequest.model_validate(good)).job_id == "bad-0"
    check_output(client.wait(["bad-0"], timeout=30)["bad-0"], p, b)


def test_image_bytes_in_and_out(client, data):
    p, b = data["items"][2]
    req = JobRequest(
        job_id="bytes-1",
        sample_id="s2",
        image=ImageRef.from_bytes(p.read_bytes()),
        boxes=b,
        description=DESCRIPTIONS[0],
        seed=5,
        return_bytes=True,
    )
    client.submit(req)
    st = client.wait(["bytes-1"], timeout=30)["bytes-1"]
    check_output(st, p, b)
    full = client.get("bytes-1")
    on_disk = Path(full.result.output_path).read_bytes()
    assert base64.b64decode(full.result.image_b64) == on_disk == client.image("bytes-1")
    assert np.asarray(Image.open(io.BytesIO(on_disk))).shape[:2] == (70, 50)


def test_list_since_cursor_and_ack(client, data):
    p, b = data["items"][3]
    start = client.list(since=0).cursor
    for i in range(3):
        client.submit(request(f"list-{i}", p, b, i))
    client.wait([f"list-{i}" for i in range(3)], timeout=30)
    page = client.list(state=JobState.done, since=start)
    assert {j.job_id for j in page.jobs} == {"list-0", "list-1", "list-2"}
    assert client.list(state="done", since=page.cursor).jobs == []  # nothing new since
    assert [j.job_id for j in client.list(state="done", since=start, limit=2).jobs] == ["list-0", "list-1"]
    path = client.get("list-0").result.output_path
    assert client.ack("list-0").acknowledged and not client.ack("list-0").acknowledged
    with pytest.raises(SynthError) as e:
        client.get("list-0")
    assert e.value.status_code == 404 and "acknowledged" in e.value.detail
    assert os.path.exists(path)  # the file now belongs to the client
    assert client.health().counts["done"] >= 2
    with httpx.Client(base_url=client.url, headers=client._http.headers) as http:
        assert http.delete("/jobs/list-1").json() == {"job_id": "list-1", "acknowledged": True, "cancelled": False}
        assert http.get("/jobs/list-1").status_code == 404


def test_async_submitter_never_blocks_and_returns_every_job(server, data):
    p, b = data["items"][4]
    sub = AsyncSubmitter(server.client(), poll_interval=0.1, auto_ack=True)
    ids = [f"async-{i}" for i in range(5)]
    for i, j in enumerate(ids):
        sub.submit(request(j, p, b, i))
    sub.submit(request("async-bad", p, [[0, 0, 999, 5]]))  # rejected (422): reported as failed, not lost
    sub.wait(ids + ["async-bad"], timeout=30)
    got = {s.job_id: s for s in sub.pop_finished()}
    assert set(got) == set(ids) | {"async-bad"}
    assert all(got[j].state == JobState.done for j in ids)
    assert got["async-bad"].state == JobState.failed and "outside" in got["async-bad"].error
    sub.close()
    with server.client() as c:  # auto_ack acknowledged them (the ack thread ran before close returned)
        assert all(not c.ack(j).acknowledged for j in ids)


def test_async_submitter_with_the_server_down_keeps_the_job():
    sub = AsyncSubmitter(SynthClient("http://127.0.0.1:9", "t", timeout=0.5, retries=0), poll_interval=0.1)
    t0 = time.monotonic()
    sub.submit(
        JobRequest(job_id="j", sample_id="s", image=ImageRef(path="x.png"), boxes=[[0, 0, 1, 1]], description="")
    )
    assert time.monotonic() - t0 < 0.5  # only enqueued
    deadline = time.monotonic() + 10
    while sub.stats()["last_error"] is None and time.monotonic() < deadline:
        time.sleep(0.05)
    stats = sub.stats()
    assert stats["unsent"] == 1 and stats["last_error"] and "submit" in stats["last_error"]
    sub.close(timeout=1)


@pytest.mark.slow  # two server starts (~8 s); a restart under the callback runs by default (test_synthesis_loop)
def test_async_submitter_resubmits_after_a_server_restart(data, tmp_path):
    """The job table is in memory: a restarted server has forgotten queued jobs; the submitter sends them again."""
    p, b = data["items"][7]
    port, token = free_port(), "restart-token"
    common = dict(roots=[data["root"]], output_dir=tmp_path / "out", port=port, token=token, startup_timeout=60)
    first = LocalServer(overrides={"painter.delay_s": 5.0}, **common)
    first.start()
    sub = AsyncSubmitter(first.client(retries=1, backoff=0.05), poll_interval=0.1)
    try:
        for i in range(3):
            sub.submit(request(f"restart-{i}", p, b, i))
        deadline = time.monotonic() + 20
        while sub.stats()["in_flight"] < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert sub.stats()["in_flight"] == 3
        first.stop()  # the jobs die with it, unfinished
        with LocalServer(**common):
            sub.wait([f"restart-{i}" for i in range(3)], timeout=30)
            got = sub.pop_finished()
        assert sorted(s.job_id for s in got) == [f"restart-{i}" for i in range(3)]
        for s in got:
            check_output(s, p, b)
    finally:
        sub.close(timeout=2)
        first.stop()


def test_a_painter_that_cannot_load_is_reported_clearly(data, tmp_path):
    bad = {"painter": {"name": "no_such_module:Painter"}, "max_restarts": 0}
    with pytest.raises(RuntimeError, match="workers cannot start.*No module named 'no_such_module'"):
        with LocalServer(roots=[data["root"]], output_dir=tmp_path, overrides=bad, startup_timeout=60):
            pass


def test_a_server_started_alone_exits_when_no_worker_ever_starts(data, tmp_path):
    """``python -m synth.server`` whose painter cannot load (missing weights, a bad device) gives up its workers after
    ``max_restarts`` and exits 4 with the reason, rather than keep serving 503s with no worker (docs/data_server.md)."""
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    args = ["--port", "0", "--set", "auth=false", "--set", f"output_dir={tmp_path}", "--set", "max_restarts=0"]
    args += ["--set", "painter.name=no_such_module:Painter", "--set", f"roots=[{data['root']}]"]
    env = {**os.environ, "PYTHONPATH": str(repo)}
    proc = subprocess.run(
        [sys.executable, "-m", "synth.server", *args], cwd=repo, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 4, proc.stderr[-2000:]
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("synth.server: exiting, the workers cannot start") and "no_such_module" in last


# --- a slow painter: queue limits and crashes ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def slow_server(data, tmp_path_factory):
    overrides = {"painter.delay_s": 0.8, "max_attempts": 2, "max_queued": 3, "job_timeout_s": 20}
    with LocalServer(
        roots=[data["root"]], output_dir=tmp_path_factory.mktemp("slow-out"), overrides=overrides, startup_timeout=60
    ) as s:
        yield s


def wait_busy(c: SynthClient, job_id: str, not_pid: int | None = None, timeout: float = 30.0) -> int:
    """Pid of the worker once it is running ``job_id`` (a worker other than ``not_pid``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        w = c.health().workers[0]
        if w.busy == [job_id] and w.alive and w.pid != not_pid:
            return w.pid
        time.sleep(0.03)
    raise TimeoutError(f"{job_id} never ran")


def test_full_queue_answers_429(slow_server, data):
    p, b = data["items"][5]
    with slow_server.client(retries=0) as c:
        c.submit(request("q-0", p, b))
        wait_busy(c, "q-0")
        for i in range(1, 4):
            c.submit(request(f"q-{i}", p, b, i))  # 3 queued: the limit
        with pytest.raises(SynthError) as e:
            c.submit(request("q-4", p, b, 4))
        assert e.value.status_code == 429 and "queue full" in e.value.detail
        done = c.wait([f"q-{i}" for i in range(4)], timeout=30)
        assert all(s.state == JobState.done for s in done.values())


def test_worker_killed_mid_job_is_retried_then_failed_and_nothing_else_is_lost(slow_server, data):
    p, b = data["items"][6]
    with slow_server.client() as c:
        for j in ("k-a", "k-b", "k-c"):
            c.submit(request(j, p, b))
        pid = wait_busy(c, "k-a")  # the worker's pid comes from /health
        os.kill(pid, signal.SIGKILL)
        done = c.wait(["k-a", "k-b", "k-c"], timeout=40)
        assert done["k-a"].state == JobState.done and done["k-a"].attempts == 2  # retried on the new worker
        assert done["k-b"].state == done["k-c"].state == JobState.done
        assert done["k-b"].attempts == done["k-c"].attempts == 1
        check_output(done["k-a"], p, b)
        new_pid = c.health().workers[0].pid
        assert new_pid != pid

        # A job that kills its worker every time: failed after max_attempts = 2, with the reason.
        c.submit(request("k-poison", p, b))
        c.submit(request("k-after", p, b))
        first = wait_busy(c, "k-poison")
        os.kill(first, signal.SIGKILL)
        os.kill(wait_busy(c, "k-poison", not_pid=first), signal.SIGKILL)
        done = c.wait(["k-poison", "k-after"], timeout=40)
        assert done["k-poison"].state == JobState.failed and done["k-poison"].attempts == 2
        assert "SIGKILL" in done["k-poison"].error and "max_attempts" in done["k-poison"].error
        assert done["k-after"].state == JobState.done
        h = c.health()
        assert h.status == "ok" and h.workers[0].restarts == 3


# --- the diffusers painter behind the server -----------------------------------------------------------------------


def test_tiny_diffusers_server_completes_jobs_with_exact_foreground(data, tmp_path):
    cfg = REPO / "configs" / "synth" / "tiny_diffusers.yaml"
    with LocalServer(cfg, roots=[data["root"]], output_dir=tmp_path / "out", startup_timeout=120) as s:
        with s.client(timeout=30) as c:
            items = data["items"][:4]
            extends = [0.0, 0.5, 0.0, 0.25]
            for i, (p, b) in enumerate(items):
                c.submit(request(f"sdxl-{i}", p, b, i, canvas={"extend": extends[i]}))
            done = c.wait([f"sdxl-{i}" for i in range(4)], timeout=120)
            for i, (p, b) in enumerate(items):
                check_output(done[f"sdxl-{i}"], p, b, extends[i])
                assert done[f"sdxl-{i}"].result.painter == "diffusers"


def test_a_burst_of_jobs_is_painted_in_full_batches_with_a_window(data, tmp_path):
    """Jobs arrive one request at a time; with ``batch_window_s`` an idle worker waits for a full batch instead of
    painting the first job of the burst alone (a wasted pipeline call on a GPU painter)."""
    over = {"batch_size": 4, "batch_window_s": 2.0}
    with LocalServer(roots=[data["root"]], output_dir=tmp_path / "out", overrides=over, startup_timeout=60) as s:
        with s.client(timeout=20) as c:
            ids = []
            for i in range(8):
                p, b = data["items"][i % len(data["items"])]
                c.submit(request(f"burst-{i}", p, b, i))
                ids.append(f"burst-{i}")
            done = c.wait(ids, timeout=60)
    assert all(st.state == "done" for st in done.values())
    assert [done[i].result.batch_size for i in ids] == [4] * 8
