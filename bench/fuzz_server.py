"""Fuzz the data server and print how many requests it answered with a 5xx (the figure that must be 0).

Starts a real server (``python -m synth.server`` on 127.0.0.1, procedural painter, real workers) through
``synth.client.LocalServer``, then sends:

- schemathesis cases over the server's own ``/openapi.json``: every operation, positive and negative generation,
  ``--examples`` cases per operation and mode, once per seed in ``--seeds``; every response is checked for a server
  error and for conformance to the schema (status code, content type, body shape, headers, negative data rejected);
- ``--bodies`` hypothesis ``POST /jobs`` bodies carrying real images (PNG / JPEG / GIF / BMP / WebP of several modes,
  some cut short), paths under the roots, outside them and nowhere, boxes in and out of the image, odd canvases;
  the accepted jobs are waited for and their audits counted.

    python bench/fuzz_server.py --examples 300 --seeds 0 1 2 3 4 --bodies 1500 \\
        --out bench/results/fuzz_server_cpu.json

Only loopback traffic. Prints figures; never asserts (``tests/synth/test_synth_fuzz.py`` is the bounded in-suite version).
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
from synth.fuzz import FuzzReport, fuzz_bodies, fuzz_schema  # noqa: E402


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
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--bodies", type=int, default=1500, help="hypothesis job bodies with real images")
    parser.add_argument("--workers", type=int, default=1, help="painter worker processes (cpu)")
    parser.add_argument("--out", help="write the report as JSON here")
    args = parser.parse_args(argv)

    with tempfile.TemporaryDirectory(prefix="fuzz-server-") as tmp:
        root, out = Path(tmp) / "images", Path(tmp) / "out"
        root.mkdir()
        rng = np.random.default_rng(0)
        paths = []
        for i, (w, h) in enumerate([(40, 30), (64, 48), (23, 71), (96, 96)]):
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / f"{i}.png")
            paths.append(str(root / f"{i}.png") if i % 2 else f"{i}.png")
        t0 = time.perf_counter()
        with LocalServer(roots=[root], output_dir=out, overrides={"devices": ["cpu"] * args.workers}) as server:
            total = FuzzReport()
            runs = []
            for seed in args.seeds:
                r = fuzz_schema(server.url, server.token, max_examples=args.examples, seed=seed)
                total.merge(r)
                runs.append({"kind": "schemathesis", "seed": seed, **r.as_dict(max_lines=10)})
                print(
                    f"schemathesis seed {seed}: {r.requests} requests, {r.n_server_errors} 5xx, "
                    f"{len(r.nonconforming)} nonconforming, {r.seconds:.0f} s",
                    flush=True,
                )
            if args.bodies:
                r = fuzz_bodies(server.url, server.token, paths, max_examples=args.bodies, seed=args.seeds[0])
                total.merge(r)
                runs.append({"kind": "bodies", "seed": args.seeds[0], **r.as_dict(max_lines=10)})
                print(
                    f"bodies: {r.requests} requests, {r.n_server_errors} 5xx, jobs done {r.jobs_done}, "
                    f"failed {r.jobs_failed}, audits failed {r.audits_failed}, {r.seconds:.0f} s",
                    flush=True,
                )
            with server.client() as c:
                health = c.health()
            leftovers = sorted(p.name for p in out.iterdir() if p.name.endswith(".tmp"))
        wall = time.perf_counter() - t0

    report = {
        "date": datetime.datetime.now().isoformat(timespec="seconds"),
        "machine": _machine(),
        "command": "python3 " + " ".join([os.path.relpath(__file__, REPO), *(argv or sys.argv[1:])]),
        "requests": total.requests,
        "server_errors": total.n_server_errors,
        "nonconforming": len(total.nonconforming),
        "jobs": {
            "done": total.jobs_done,
            "failed": total.jobs_failed,
            "audits_failed": total.audits_failed,
            "unfinished": total.jobs_unfinished,
        },
        "server_health_after": health.status,
        "temp_files_left": leftovers,
        "wall_s": round(wall, 1),
        "by_status": {str(k): v for k, v in sorted(total.by_status.items())},
        "runs": runs,
    }
    print(
        f"{total.requests} requests, {total.n_server_errors} server errors (>= 500), "
        f"{len(total.nonconforming)} nonconforming answers, jobs done {total.jobs_done}, "
        f"audits failed {total.audits_failed}, health after: {health.status}, {wall:.0f} s"
    )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
