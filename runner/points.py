"""Points: ``train.py`` command lines run as processes, a bounded number at a time, each with its own folder and log.

The engine of the sweeps (`runner.sweep`: one point per grid point) and the studies (`runner.study`: a training point
per (row, seed), its export and evaluation chained as ``then``).
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Point:
    """One run of a sweep: its name (the folder under the sweep's output) and its parameters and command."""

    name: str
    params: dict[str, Any]
    argv: list[str]
    folder: Path | None = None
    returncode: int | None = None
    seconds: float | None = None
    log: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    then: Point | None = None
    """A point to start as soon as this one exits with 0 (a study's evaluation after its training run)."""
    log_name: str = "train.log"
    """The file in ``folder`` that receives the command's output."""


def run_points(
    points: list[Point],
    jobs: int = 1,
    env: Mapping[str, str] | None = None,
    quiet: bool = False,
    on_done: Callable[[Point], None] | None = None,
    status_every: float = 60.0,
) -> None:
    """Run every point's command (``jobs`` at a time) in the repository root, each with its output in
    ``<folder>/<log_name>`` (``train.log``); fills ``returncode``, ``seconds`` and ``log``. A point's ``then`` starts
    (before the points still pending) once the point exits with 0; ``on_done(point)`` is called as each one exits.
    Unless ``quiet``, every ``status_every`` seconds one ``[run  ]`` line per running point says where it is
    (:func:`progress`), so a sweep of long fits is never silent between its ``[start]`` and ``[done ]`` lines."""
    env = {**os.environ, **(env or {})}
    pending = list(points)
    running: list[tuple[Point, subprocess.Popen, float, Any]] = []
    last_status = time.monotonic()
    while pending or running:
        while pending and len(running) < max(1, jobs):
            p = pending.pop(0)
            assert p.folder is not None
            p.folder.mkdir(parents=True, exist_ok=True)
            p.log = p.folder / p.log_name
            fh = p.log.open("w", encoding="utf-8")
            fh.write("$ " + " ".join(p.argv) + "\n")
            fh.flush()
            proc = subprocess.Popen(p.argv, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT)
            running.append((p, proc, time.monotonic(), fh))
            if not quiet:
                print(f"[start] {p.name}", flush=True)
        time.sleep(0.2)
        still = []
        for p, proc, t0, fh in running:
            rc = proc.poll()
            if rc is None:
                still.append((p, proc, t0, fh))
                continue
            fh.close()
            p.returncode, p.seconds = rc, time.monotonic() - t0
            if not quiet:
                status = "ok" if rc == 0 else f"FAILED (exit {rc}; see {p.log})"
                print(f"[done ] {p.name}: {status} in {p.seconds:.0f} s", flush=True)
            if on_done is not None:
                on_done(p)
            if rc == 0 and p.then is not None:
                pending.insert(0, p.then)
        running = still
        if not quiet and running and time.monotonic() - last_status >= status_every:
            last_status = time.monotonic()
            for p, _, t0, _ in running:
                print(f"[run  ] {p.name}: {(last_status - t0) / 60:.0f} min, {progress(p)}", flush=True)


def progress(p: Point) -> str:
    """Where a running point is: the step and epoch of the last line of its ``metrics.jsonl`` (with its newest
    validation figure), else the last line of its log, else ``starting``."""
    row = _last_line(p.folder / "metrics.jsonl") if p.folder is not None else ""
    try:
        rec = json.loads(row) if row else None
    except json.JSONDecodeError:
        rec = None
    if isinstance(rec, dict) and "step" in rec:
        val = next((f", {k} {v:.3g}" for k, v in rec.items() if k.startswith("val/") and isinstance(v, float)), "")
        return f"step {rec['step']}" + (f", epoch {rec['epoch']}" if "epoch" in rec else "") + val
    line = _last_line(p.log) if p.log is not None else ""
    return line[-120:] if line else "starting"


def _last_line(path: Path, tail: int = 8192) -> str:
    """The last non-empty line (a progress bar's last ``\\r`` frame) of ``path``'s last ``tail`` bytes, or ``""``."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - tail))
            text = fh.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    lines = [ln.strip() for ln in text.replace("\r", "\n").splitlines() if ln.strip()]
    return lines[-1] if lines else ""
