"""Fuzz the data server and print how many requests it answered with a 5xx and how many jobs of one client the
other client touched (the two figures that must be 0).

Starts a real server (``python -m synth.server`` on 127.0.0.1, procedural painter, real workers) through
``synth.client.LocalServer``; then two clients, each with its own token, fuzz it at the same time
(``synth.fuzz.fuzz_clients``):

- schemathesis cases over the server's own ``/openapi.json``: every operation, positive and negative generation,
  ``--examples`` cases per operation and mode, once per seed in ``--seeds``; every response is checked for a server
  error and for conformance to the schema (status code, content type, body shape, headers, negative data rejected);
- ``--bodies`` hypothesis ``POST /jobs`` bodies carrying real images (PNG / JPEG / GIF / BMP / WebP of several modes,
  some cut short), paths under the roots, outside them and nowhere, boxes in and out of the image, odd canvases;
  the accepted jobs are waited for and their audits counted;
- each client holds marked jobs it does not acknowledge, and tries to read, fetch and acknowledge the other's;
- then ``--race-seconds`` (60) of each race of ``synth.races``: an input's folder, then the input itself, swapped
  again and again for a link to a file outside the roots while jobs that name it run; every output is read back and
  the ones carrying the outside file's pixels are counted (the figure that must be 0).

    make fuzz        # python bench/fuzz_server.py: the defaults send >= 50,000 requests (~15-25 min on 2 cores)

Only loopback traffic. Prints figures; never asserts (``tests/synth/test_synth_fuzz.py`` is the bounded in-suite
version).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from synth.client import LocalServer  # noqa: E402
from synth.fuzz import FuzzReport, fuzz_clients  # noqa: E402
from synth.races import can_exchange, lay_out, race  # noqa: E402


def _machine() -> dict:
    import hypothesis
    import schemathesis

    return {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "loadavg_1m": os.getloadavg()[0],
        "schemathesis": schemathesis.__version__ if hasattr(schemathesis, "__version__") else "?",
        "hypothesis": hypothesis.__version__,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--examples", type=int, default=300, help="schemathesis cases per operation, mode and seed")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4, 5])
    parser.add_argument("--bodies", type=int, default=1500, help="hypothesis job bodies with real images, per client")
    parser.add_argument("--workers", type=int, default=1, help="painter worker processes (cpu)")
    parser.add_argument(
        "--race-seconds", type=float, default=60.0,
        help="then race each of a folder swap and a file swap against the roots this long (0: skip; synth.races)",
    )  # fmt: skip
    parser.add_argument("--out", help="write the report as JSON here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="fuzz-server-") as tmp:
        root, out, race_root = Path(tmp) / "images", Path(tmp) / "out", Path(tmp) / "race"
        root.mkdir()
        lay_out(race_root, Path(tmp) / "outside")
        rng = np.random.default_rng(0)
        paths = []
        for i, (w, h) in enumerate([(40, 30), (64, 48), (23, 71), (96, 96)]):
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / f"{i}.png")
            paths.append(str(root / f"{i}.png") if i % 2 else f"{i}.png")
        t0 = time.perf_counter()
        roots = [root, race_root]
        with LocalServer(roots=roots, output_dir=out, overrides={"devices": ["cpu"] * args.workers}) as server:
            reports, iso = fuzz_clients(
                server.url, server.token, paths, max_examples=args.examples, seeds=tuple(args.seeds), bodies=args.bodies
            )
            races = []
            if args.race_seconds > 0 and can_exchange(race_root):
                with server.client(client_id="racer") as c:
                    for kind in ("folder", "file"):
                        races.append(race(c, race_root, kind=kind, seconds=args.race_seconds))
                        print(races[-1].line(), flush=True)
            elif args.race_seconds > 0:
                print("races skipped: this file system cannot swap two names atomically (renameat2)", flush=True)
            with server.client() as c:
                health = c.health()
            leftovers = sorted(p.name for p in out.rglob("*.tmp"))
        wall = time.perf_counter() - t0

    total = FuzzReport()
    for name, r in reports.items():
        total.merge(r)
        print(
            f"client {name}: {r.requests} requests, {r.n_server_errors} 5xx, {len(r.nonconforming)} nonconforming, "
            f"jobs done {r.jobs_done}, failed {r.jobs_failed}, audits failed {r.audits_failed}",
            flush=True,
        )
    touched = sum(iso.touched.values())
    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": _machine(),
        "command": "python3 " + " ".join([os.path.relpath(__file__, REPO), *(argv or sys.argv[1:])]),
        "requests": total.requests,
        "server_errors": total.n_server_errors,
        "nonconforming": len(total.nonconforming),
        "isolation": {
            "touched": iso.touched,
            "kept": iso.kept,
            "foreign_in_list": iso.foreign_in_list,
            "probes": iso.probes,
        },
        "jobs": {
            "done": total.jobs_done,
            "failed": total.jobs_failed,
            "audits_failed": total.audits_failed,
            "unfinished": total.jobs_unfinished,
        },
        "races": [vars(r) for r in races],
        "server_health_after": health.status,
        "temp_files_left": leftovers,
        "wall_s": round(wall, 1),
        "by_status": {str(k): v for k, v in sorted(total.by_status.items())},
        "by_client": {name: r.as_dict(max_lines=10) for name, r in reports.items()},
    }
    print(
        f"{total.requests} requests, {total.n_server_errors} server errors (>= 500), "
        f"{len(total.nonconforming)} nonconforming answers, {touched} jobs of one client touched by the other "
        f"({iso.probes} probes, {iso.foreign_in_list} foreign jobs listed), jobs done {total.jobs_done}, "
        f"audits failed {total.audits_failed}, health after: {health.status}, {wall:.0f} s; "
        f"{sum(r.leaked for r in races)} outputs read from outside the roots in {len(races)} races"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
