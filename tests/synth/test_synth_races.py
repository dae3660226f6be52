"""The data server's roots hold under races, and it writes nothing through a link: a folder (or file) swapped for a
link to outside the roots while jobs are checked and run is never read; a client's output folder replaced by a link
is never written through; the reserved client id ``admin`` cannot be used; a served output rewritten in place is
refused even with its mtime set back; ``/health`` takes ``?client=`` and shows a client only its own jobs. A real
``python -m synth.server`` on 127.0.0.1 (``make fuzz`` runs the same races for 60 s each).
"""

from __future__ import annotations

import hmac
import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from synth.api import JobRequest, client_token
from synth.client import LocalServer, SynthError
from synth.races import can_exchange, lay_out, race

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    base = tmp_path_factory.mktemp("races")
    root, out, outside = base / "root", base / "out", base / "outside"
    lay_out(root, outside)
    with LocalServer(roots=[root, out], output_dir=out, startup_timeout=60) as server:
        yield {"base": base, "root": root, "out": out, "outside": outside, "server": server}


def _tree(folder: Path) -> dict[str, tuple[int, int]]:
    return {str(p): (p.stat().st_size, p.stat().st_mtime_ns) for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kind", ["folder", "file"])
def test_a_swap_race_reads_nothing_outside_the_roots(world, kind):
    if not can_exchange(world["root"]):
        pytest.skip("this file system cannot swap two names atomically (renameat2 RENAME_EXCHANGE)")
    with world["server"].client(client_id=f"racer-{kind}") as c:
        report = race(c, world["root"], kind=kind, jobs=160)
    assert report.errors == [], report.errors
    assert report.leaked == 0, report.line()
    assert report.swaps > 0 and report.submitted == 160
    assert report.done > 0, report.line()  # the race did not just refuse everything: jobs ran between swaps


def test_a_linked_client_folder_is_never_written_through(world):
    out, victim_dir = world["out"], world["base"] / "victim"
    victim_dir.mkdir()
    (victim_dir / "victim.png").write_bytes(b"keep me")
    (out / "c1").symlink_to(victim_dir, target_is_directory=True)
    before = _tree(victim_dir)
    with world["server"].client(client_id="c1") as c:
        req = JobRequest(
            job_id="victim", sample_id="v", image={"path": "d/img.png"}, boxes=[[0, 0, 8, 8]], description=""
        )
        with pytest.raises(SynthError) as e:
            c.submit(req)
    assert e.value.status_code == 409 and "symbolic link" in e.value.detail
    assert _tree(victim_dir) == before and (victim_dir / "victim.png").read_bytes() == b"keep me"
    # the folder swapped for a link after the job was accepted: the worker refuses to write, the job fails
    (out / "c1").unlink()
    with world["server"].client(client_id="c1") as c:
        (out / "c1").mkdir(exist_ok=True)
        status = c.submit(req)
        os.rename(out / "c1", world["base"] / "c1-real")
        (out / "c1").symlink_to(victim_dir, target_is_directory=True)
        status = c.wait(["victim"], timeout=30)["victim"]
    assert _tree(victim_dir) == before
    if status.state.value == "done":  # the worker won the race and wrote before the swap: into the real folder
        assert (world["base"] / "c1-real" / "victim.png").exists()
    else:
        assert "link" in status.error, status.error


def test_the_admin_client_id_is_reserved(world):
    server = world["server"]
    with pytest.raises(ValueError, match="reserved"):
        client_token(server.token, "admin")
    env = {**os.environ, "SYNTH_TOKEN": server.token}
    out = subprocess.run(
        [sys.executable, "-m", "synth.server", "token", "admin"], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert out.returncode == 2 and "reserved" in out.stderr
    import hashlib

    forged = "admin." + hmac.new(server.token.encode(), b"synth-client:admin", hashlib.sha256).hexdigest()
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {forged}"}) as http:
        assert http.get("/jobs").status_code == 401


def test_an_output_rewritten_in_place_is_not_served(world):
    with world["server"].client(client_id="rewriter") as c:
        c.submit(
            JobRequest(job_id="w", sample_id="w", image={"path": "d/img.png"}, boxes=[[0, 0, 8, 8]], description="")
        )
        path = Path(c.wait(["w"], timeout=30)["w"].result.output_path)
        st = path.stat()
        data = bytearray(path.read_bytes())
        data[-20] ^= 0xFF
        path.write_bytes(bytes(data))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        assert path.stat().st_size == st.st_size and path.stat().st_mtime_ns == st.st_mtime_ns
        with pytest.raises(SynthError) as e:
            c.image("w")
        assert e.value.status_code == 410


def test_health_takes_client_and_shows_a_client_only_its_own_jobs(world):
    server = world["server"]
    with server.client(client_id="h1") as c:
        c.submit(
            JobRequest(job_id="x", sample_id="x", image={"path": "d/img.png"}, boxes=[[0, 0, 8, 8]], description="")
        )
        c.wait(["x"], timeout=30)
    with httpx.Client(
        base_url=server.url, headers={"Authorization": f"Bearer {client_token(server.token, 'h2')}"}
    ) as h:
        r = h.get("/health", params={"client": "h2"})
        assert r.status_code == 200 and sum(r.json()["counts"].values()) == 0
        assert h.get("/health", params={"client": "h1"}).status_code == 403
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Bearer {server.token}"}) as h:
        mine = h.get("/health", params={"client": "h1"}).json()["counts"]
        assert mine["done"] == 1 and sum(mine.values()) == 1
        assert sum(h.get("/health").json()["counts"].values()) >= 1


def test_only_the_file_the_worker_wrote_is_published(tmp_path):
    """The HTTP process renames a temp file into place only if it is still the one the worker wrote and audited
    (its identity once written) with one link: a file swapped in after the audit, or a hard link to one, is refused."""
    from synth.inputs import file_identity
    from synth.outputs import publish

    folder = tmp_path / "c1"
    folder.mkdir()
    tmp, out = folder / ".o.png.tmp", folder / "o.png"
    tmp.write_bytes(b"audited")
    written = file_identity(tmp.stat())
    tmp.unlink()
    tmp.write_bytes(b"swapped in after the audit")
    with pytest.raises(OSError, match="not the file the worker wrote"):
        publish(tmp_path, str(tmp), str(out), written)
    written = file_identity(tmp.stat())
    os.link(tmp, tmp_path / "elsewhere")
    with pytest.raises(OSError, match="not the file the worker wrote"):
        publish(tmp_path, str(tmp), str(out), written)
    (tmp_path / "elsewhere").unlink()
    written = file_identity(tmp.stat())  # the link's removal changed the change time: the file as it is now
    identity = publish(tmp_path, str(tmp), str(out), written)
    assert out.read_bytes() == b"swapped in after the audit" and identity[:2] == written[:2] and not tmp.exists()
