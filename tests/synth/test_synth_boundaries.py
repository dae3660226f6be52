"""The data server's boundaries, tried as an attacker would: jobs belong to the client whose token submitted them,
files are read and served only inside the roots (symlinks, hard links, ``..``), bodies are strict JSON, a 405 says
what is allowed, and an orphaned worker exits without a traceback. A real ``python -m synth.server`` on 127.0.0.1.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from PIL import Image

from synth.api import client_token
from synth.client import LocalServer, SynthClient, SynthError

REPO = Path(__file__).resolve().parents[2]
SECRET = "not-an-image-but-a-secret\n" * 4


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """A root with one image, a secret file outside every root, and a running server."""
    base = tmp_path_factory.mktemp("boundaries")
    root, out = base / "root", base / "out"
    root.mkdir()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (30, 40, 3), dtype=np.uint8)).save(root / "a.png")
    secret = base / "secret.txt"
    secret.write_text(SECRET)
    Image.fromarray(np.full((30, 40, 3), 7, np.uint8)).save(base / "outside.png")
    # the output folder is a root too, as a trainer's local server has it (a sample's current image is an output)
    with LocalServer(roots=[root, out], output_dir=out, startup_timeout=60) as server:
        yield {"root": root, "out": out, "secret": secret, "outside": base / "outside.png", "server": server}


def body(job_id: str, path: str = "a.png", **extra) -> dict:
    return {
        "job_id": job_id,
        "sample_id": job_id,
        "image": {"path": path},
        "boxes": [[2, 2, 12, 12]],
        "description": "",
    }


def post(http: httpx.Client, payload, content_type: str = "application/json") -> httpx.Response:
    data = payload if isinstance(payload, str) else json.dumps(payload)
    return http.post("/jobs", content=data, headers={"Content-Type": content_type})


def http_as(server: LocalServer, token: str) -> httpx.Client:
    return httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {token}"}, timeout=30)


def wait_done(c: SynthClient, job_id: str):
    """Submit a job on ``a.png`` and wait for it."""
    c.submit(JobReq(job_id))
    return c.wait([job_id], timeout=30)[job_id]


def test_jobs_belong_to_the_client_whose_token_submitted_them(world):
    server = world["server"]
    with server.client(client_id="alice") as alice, server.client(client_id="bob") as bob:
        a = wait_done(alice, "same-id")
        assert alice.submit(JobReq("same-id")).client == "alice"  # idempotent resubmission, alice's own job
        assert Path(a.result.output_path).parent.name == "alice"
        for call in (
            lambda: bob.get("same-id"),
            lambda: bob.image("same-id"),
        ):
            with pytest.raises(SynthError) as e:
                call()
            assert e.value.status_code == 404
        assert not bob.ack("same-id").acknowledged  # bob cannot acknowledge (or cancel) alice's job
        with http_as(server, client_token(server.token, "bob")) as http:
            assert http.delete("/jobs/same-id").json()["acknowledged"] is False
        assert [j.job_id for j in bob.list().jobs] == []
        # bob's own job with the same id is his, in his own folder: the two never meet
        b = wait_done(bob, "same-id")
        assert b.client == "bob" and Path(b.result.output_path).parent.name == "bob"
        assert b.result.output_path != a.result.output_path
        assert alice.get("same-id").state.value == "done"
        # the admin sees both and acts in a client's name with ?client=; a client may not
        with server.client() as admin:
            clients = {(j.client, j.job_id) for j in admin.list().jobs}
            assert {("alice", "same-id"), ("bob", "same-id")} <= clients
        with http_as(server, server.token) as http:
            assert http.get("/jobs/same-id", params={"client": "alice"}).json()["client"] == "alice"
        with http_as(server, client_token(server.token, "bob")) as http:
            r = http.get("/jobs/same-id", params={"client": "alice"})
            assert r.status_code == 403 and "admin" in r.json()["detail"]
            assert http.get("/health").json()["workers"][0]["busy"] == []
        assert alice.ack("same-id").acknowledged and bob.ack("same-id").acknowledged


def JobReq(job_id: str, path: str = "a.png"):
    from synth.api import JobRequest

    return JobRequest(**body(job_id, path))


def test_a_forged_or_foreign_client_token_is_refused(world):
    server = world["server"]
    good = client_token(server.token, "carol")
    for token in (good[:-1] + ("0" if good[-1] != "0" else "1"), client_token("another-secret", "carol"), "carol"):
        with http_as(server, token) as http:
            assert http.get("/jobs").status_code == 401
    with pytest.raises(ValueError, match="not 'dave'"):
        SynthClient(server.url, good, client_id="dave")
    # the operator's command prints the same token as the library
    env = {**os.environ, "SYNTH_TOKEN": server.token}
    cmd = [sys.executable, "-m", "synth.server", "token", "carol"]
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == good


def test_a_link_put_in_place_of_an_output_is_never_followed(world):
    server, secret = world["server"], world["secret"]
    with server.client(client_id="mallory") as c:
        for i, kind in enumerate(("symlink", "hardlink", "other-file")):
            job_id = f"swap-{i}"
            path = Path(wait_done(c, job_id).result.output_path)
            assert c.image(job_id)[:4] == b"\x89PNG"
            path.unlink()
            if kind == "symlink":
                path.symlink_to(secret)
            elif kind == "hardlink":
                os.link(secret, path)
            else:
                path.write_text(SECRET)
            for call in (lambda j=job_id: c.image(j), lambda j=job_id: c.get(j, include_image=True)):
                with pytest.raises(SynthError) as e:
                    call()
                assert e.value.status_code == 410 and "no longer on disk as written" in e.value.detail, kind
            with http_as(server, client_token(server.token, "mallory")) as http:
                r = http.get(f"/jobs/{job_id}/image")
                assert r.status_code == 410 and b"secret" not in r.content
            path.unlink()
            c.ack(job_id)


def test_inputs_are_read_only_inside_the_roots(world):
    root, server = world["root"], world["server"]
    (root / "up.png").symlink_to(world["outside"])
    os.link(world["outside"], root / "hard.png")
    (root / "sub").mkdir()
    cases = [
        ("up.png", 403, "symbolic link"),  # a symlink out of the root: no link is followed below a root
        ("hard.png", 403, "hard links"),  # a hard link to a file outside
        ("sub/../../outside.png", 403, "outside the server's roots"),
        (str(root / ".." / "secret.txt"), 403, "outside the server's roots"),
        ("sub/../a.png", 202, None),  # '..' that stays inside is fine
    ]
    with http_as(server, client_token(server.token, "eve")) as http:
        for i, (path, status, words) in enumerate(cases):
            r = post(http, body(f"in-{i}", path))
            assert r.status_code == status, (path, r.text)
            if words:
                assert words in r.json()["detail"], path
        # another client's output is not an input this client may read
        with server.client(client_id="frank") as frank:
            theirs = wait_done(frank, "private").result.output_path
        r = post(http, body("peek", theirs))
        assert r.status_code == 403 and "another client's output" in r.json()["detail"]


def test_bodies_are_strict_json_and_query_strings_parse_as_documented(world):
    server = world["server"]
    with http_as(server, client_token(server.token, "grace")) as http:
        for bad in ({"seed": True}, {"seed": "1_0"}, {"seed": 3.0}, {"boxes": [[2, 2, "12", 12]]}, {"boxes": [[]]}):
            r = post(http, {**body("strict"), **bad})
            assert r.status_code == 422, (bad, r.text)
        r = post(http, {**body("strict"), "image": {"path": None, "data_b64": None}})
        assert r.status_code == 422
        assert post(http, body("strict"), content_type="text/plain").status_code == 415
        assert http.post("/jobs", content=json.dumps(body("strict"))).status_code == 415  # no content type
        assert post(http, body("strict")).status_code == 202
        for params in ({"since": "1_0"}, {"since": "+1"}, {"limit": "0x10"}):
            r = http.get("/jobs", params=params)
            assert r.status_code == 422 and "decimal digits" in r.json()["detail"], params
        assert http.get("/jobs", params={"since": "10"}).status_code == 200
        r = http.get("/jobs/strict", params={"include_image": "yes"})
        assert r.status_code == 422 and "true or false" in r.json()["detail"]
        assert http.get("/jobs/strict", params={"include_image": "false"}).status_code == 200
        r = http.options("/jobs")
        assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "POST"}
        r = http.put("/jobs/strict")
        assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "DELETE"}


def test_the_schema_states_what_the_validator_enforces(world):
    server = world["server"]
    with http_as(server, server.token) as http:
        schema = http.get("/openapi.json").json()
    parts = schema["components"]["schemas"]
    image = parts["ImageRef"]
    assert {tuple(alt["required"]) for alt in image["oneOf"]} == {("path",), ("data_b64",)}
    box = parts["JobRequest"]["properties"]["boxes"]["items"]
    assert box["minItems"] == box["maxItems"] == 4
    post_responses = schema["paths"]["/jobs"]["post"]["responses"]
    assert {"403", "415", "422"} <= set(post_responses)
    assert "Allow" in schema["paths"]["/jobs/{job_id}"]["get"]["responses"]["405"]["headers"]
    for ops in schema["paths"].values():
        for op in ops.values():
            if any(p["name"] == "client" for p in op.get("parameters", [])):
                assert "403" in op["responses"]


def test_an_orphaned_worker_exits_quietly(tmp_path):
    root = tmp_path / "root"
    root.mkdir()
    Image.fromarray(np.zeros((30, 40, 3), np.uint8)).save(root / "a.png")
    log = tmp_path / "server.log"
    server = LocalServer(
        roots=[root], output_dir=tmp_path / "out", overrides={"painter.delay_s": 1.0}, log_path=log, startup_timeout=60
    )
    server.start()
    try:
        with server.client(client_id="orphan") as c:
            worker = c.health().workers[0].pid
            c.submit(JobReq("slow"))
            deadline = time.monotonic() + 20
            while not c.health().workers[0].busy and time.monotonic() < deadline:
                time.sleep(0.05)
        os.kill(server.proc.pid, signal.SIGKILL)  # the server dies while its worker paints
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.kill(worker, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            pytest.fail("the orphaned worker did not exit")
    finally:
        server.stop()
    assert "Traceback" not in log.read_text() and "BrokenPipe" not in log.read_text()


def test_a_run_presents_the_same_client_id_after_a_resume(tmp_path):
    from types import SimpleNamespace

    from callbacks.synthesis import SynthesisCallback

    run = tmp_path / "outputs" / "my run (1)"
    first = SynthesisCallback().client_identity(SimpleNamespace(default_root_dir=str(run)))
    resumed = SynthesisCallback().client_identity(SimpleNamespace(default_root_dir=str(run / ".." / run.name)))
    other = SynthesisCallback().client_identity(SimpleNamespace(default_root_dir=str(tmp_path / "other" / run.name)))
    assert first == resumed and first != other and first.startswith("run-my-run-1-")
    client_token("s", first)  # a valid client id
    fixed = SynthesisCallback(client_id="team-a").client_identity(SimpleNamespace(default_root_dir=str(run)))
    assert fixed == "team-a"
