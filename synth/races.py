"""Race a running data server's file checks as an attacker with a shell on its machine would: swap an input's folder
(or the input itself) for a symbolic link to a file outside the roots while jobs that name it are submitted, and count
the outputs that carry the outside file's pixels. Used by ``tests/synth/test_synth_races.py`` (a few hundred jobs)
and ``bench/fuzz_server.py`` (``make fuzz``: 60 s of each race). Needs Linux's ``renameat2(RENAME_EXCHANGE)`` to swap
two names atomically; :func:`can_exchange` says whether the file system here has it.

The inside image is all one colour and the outside one another, and each job keeps the whole image as its
foreground, so an output's kept pixels tell which file the server read. Only the given loopback server is contacted.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from PIL import Image

from synth.api import JobRequest
from synth.client import SynthClient, SynthError

INSIDE, OUTSIDE = (20, 40, 200), (230, 30, 30)
"""The colours of the image under the root and of the one outside it."""
SIZE = 32
_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _exchange(a: Path, b: Path) -> None:
    """Swap the names ``a`` and ``b`` atomically (``renameat2(RENAME_EXCHANGE)``)."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), str(a))


def can_exchange(folder: Path) -> bool:
    """True when two names in ``folder`` can be swapped atomically (Linux >= 3.15, glibc >= 2.28, a file system that
    supports it: ext4, xfs, btrfs and tmpfs do)."""
    a, b = folder / ".xchg-a", folder / ".xchg-b"
    a.write_bytes(b"a")
    b.write_bytes(b"b")
    try:
        _exchange(a, b)
        return a.read_bytes() == b"b"
    except (OSError, AttributeError):
        return False
    finally:
        a.unlink(missing_ok=True)
        b.unlink(missing_ok=True)


@dataclass
class RaceReport:
    kind: str
    submitted: int = 0
    refused: int = 0
    """Jobs the HTTP process refused (a link on the way, the file changed): the safe answer."""
    failed: int = 0
    """Accepted jobs the worker failed (it found a link, or another file than the one checked): also safe."""
    done: int = 0
    leaked: int = 0
    """Outputs that carry the outside file's pixels: the figure that must be 0."""
    swaps: int = 0
    seconds: float = 0.0
    errors: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (
            f"{self.kind} race: {self.submitted} jobs in {self.seconds:.0f} s, {self.swaps} swaps; {self.done} done, "
            f"{self.refused} refused, {self.failed} failed; {self.leaked} outputs read from outside the roots"
        )


def lay_out(root: Path, outside: Path) -> None:
    """``root/d/img.png`` (inside colour), ``outside/img.png`` (outside colour), and the links the races swap in:
    ``root/link`` -> ``outside`` (a folder) and ``root/d/img-link.png`` -> ``outside/img.png`` (a file)."""
    (root / "d").mkdir(parents=True, exist_ok=True)
    outside.mkdir(parents=True, exist_ok=True)
    Image.fromarray(np.full((SIZE, SIZE, 3), INSIDE, np.uint8)).save(root / "d" / "img.png")
    Image.fromarray(np.full((SIZE, SIZE, 3), OUTSIDE, np.uint8)).save(outside / "img.png")
    if not (root / "link").is_symlink():
        (root / "link").symlink_to(outside, target_is_directory=True)
    if not (root / "d" / "img-link.png").is_symlink():
        (root / "d" / "img-link.png").symlink_to(outside / "img.png")


def _swapper(a: Path, b: Path, stop: threading.Event, report: RaceReport) -> None:
    while not stop.is_set():
        try:
            _exchange(a, b)
            report.swaps += 1
        except OSError as e:  # pragma: no cover - the layout is the race's own
            if e.errno != errno.ENOENT:
                report.errors.append(f"swap: {e}")
                return
        time.sleep(0)


def _is_outside(png: bytes) -> bool:
    import io

    with Image.open(io.BytesIO(png)) as im:
        px = np.asarray(im.convert("RGB"), dtype=np.int16)
    centre = px[px.shape[0] // 2, px.shape[1] // 2]
    return bool(np.abs(centre - np.array(OUTSIDE)).sum() < np.abs(centre - np.array(INSIDE)).sum())


def race(
    client: SynthClient,
    root: Path,
    kind: str = "folder",
    jobs: int = 300,
    seconds: float | None = None,
    batch: int = 16,
) -> RaceReport:
    """Submit jobs naming ``root/d/img.png`` while the folder ``d`` (``kind='folder'``) or the file itself
    (``kind='file'``) is swapped again and again with a link to the outside copy; stop after ``jobs`` jobs, or after
    ``seconds`` when given. Every finished job's output is read back and checked. Call :func:`lay_out` first."""
    a, b = (root / "d", root / "link") if kind == "folder" else (root / "d" / "img.png", root / "d" / "img-link.png")
    report, stop = RaceReport(kind), threading.Event()
    swapper = threading.Thread(target=_swapper, args=(a, b, stop, report), daemon=True)
    t0 = time.monotonic()
    swapper.start()
    try:
        i = 0
        while (report.submitted < jobs) if seconds is None else (time.monotonic() - t0 < seconds):
            ids = []
            for _ in range(batch):
                job_id = f"race-{kind}-{i}"
                i += 1
                req = JobRequest(
                    job_id=job_id, sample_id=job_id, image={"path": str(root / "d" / "img.png")},
                    boxes=[[0, 0, SIZE, SIZE]], description="",
                )  # fmt: skip
                report.submitted += 1
                try:
                    client.submit(req)
                    ids.append(job_id)
                except SynthError as e:
                    if e.status_code >= 500:
                        report.errors.append(f"{job_id}: {e.status_code} {e.detail}")
                    report.refused += 1
            for job_id, status in client.wait(ids, timeout=120).items():
                if status.state.value == "done":
                    report.done += 1
                    report.leaked += _is_outside(client.image(job_id))
                else:
                    report.failed += 1
                client.ack(job_id)
    finally:
        stop.set()
        swapper.join()
        if os.path.islink(a):  # leave the layout as it was laid out
            _exchange(a, b)
    report.seconds = time.monotonic() - t0
    return report
