"""``python -m sweep configs/sweeps/beta.yaml -j 2 [--only PATTERN] [--out DIR] [--dry-run] [-- extra train.py flags]``."""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys

from sweep import SweepError, collect, plan, run_points


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, extra = argv[:i], argv[i + 1 :]
    ap = argparse.ArgumentParser(
        prog="python -m sweep",
        description="Run a W&B sweep file's grid offline: one train.py process per point, each in its own folder.",
        epilog="Flags after -- go to every point's train.py (e.g. -- --trainer.max_epochs 1).",
        allow_abbrev=False,
    )
    ap.add_argument("sweep", help="a sweep file, e.g. configs/sweeps/beta.yaml")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="points run at the same time (default 1)")
    ap.add_argument("--out", default=None, help="output folder (default outputs/sweeps/<sweep name>)")
    ap.add_argument("--dry-run", action="store_true", help="print the command lines and exit")
    ap.add_argument("--online", action="store_true", help="let W&B go online (default: WANDB_MODE=offline)")
    ap.add_argument(
        "--only",
        action="append",
        default=[],
        metavar="PATTERN",
        help="run only the points whose name matches (shell pattern, repeatable), e.g. --only 'diversity_beta=0.[15]'; "
        "--dry-run lists the names",
    )
    args = ap.parse_args(argv)
    try:
        sweep, points, out = plan(args.sweep, args.out, extra)
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.only:
        chosen = [p for p in points if any(fnmatch.fnmatchcase(p.name, pat) for pat in args.only)]
        if not chosen:
            names = ", ".join(p.name for p in points)
            print(
                f"error: --only {' '.join(args.only)} matches no point of {args.sweep}; its points: {names}",
                file=sys.stderr,
            )
            return 2
        points = chosen
    if args.dry_run:
        for p in points:
            print(" ".join(p.argv))
        return 0
    env = {"WANDB_RUN_GROUP": str(sweep.get("name") or "sweep")}
    if not args.online:
        env["WANDB_MODE"] = "offline"
    print(f"{len(points)} point(s) of {args.sweep}, {args.jobs} at a time -> {out}/", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(
        json.dumps({"sweep": args.sweep, "points": [{"name": p.name, "argv": p.argv} for p in points]}, indent=2)
    )
    run_points(points, args.jobs, env)
    metric = str(sweep.get("metric", {}).get("name", "")).rsplit("/", 1)[-1] or None
    frame = collect(points, out, metric)
    print(frame.to_string(index=False))
    print(
        f"\nresults: {out / 'results.csv'}; curves: RUNS={out} .venv/bin/jupyter nbconvert --to notebook --execute "
        f"notebooks/collapse_curves.ipynb --output-dir {out}"
    )
    failed = [p for p in points if p.returncode]
    for p in failed:
        print(f"error: point {p.name} exited with {p.returncode}; its output is in {p.log}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
