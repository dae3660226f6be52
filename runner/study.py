"""The study command (docs/study.md):

python -m runner.study STUDY.yaml [-j N] [--shard i/n] [--out DIR] [--work DIR] [--results DIR] [--dry-run] [--prune]
python -m runner.study merge STUDY.yaml [OUT ...] [--results DIR]
python -m runner.study training STUDY.yaml [OUT ...] [--key KEY ...] [--results DIR]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path

from runner.points import Point, run_points
from runner.study_file import StudyError, load_study
from runner.study_plan import Run, parse_shard, plan, prepare_data, shard
from runner.study_records import mark_trained, write_record
from runner.study_report import merge
from runner.study_training import KEYS
from runner.study_training import write as write_training


def _defaults(study_name: str, out: str | None, results: str | None) -> tuple[Path, Path]:
    return Path(out or f"outputs/study/{study_name}"), Path(results or f"experiments/results/study_{study_name}")


def _records_parser(command: str, description: str, folders_help: str) -> argparse.ArgumentParser:
    """The parser of a command that reads a study's run records: ``STUDY [OUT ...] [--results DIR]``."""
    ap = argparse.ArgumentParser(prog=f"python -m runner.study {command}", description=description, allow_abbrev=False)
    ap.add_argument("study", help="the study file, e.g. experiments/study/table1_toy.yaml")
    ap.add_argument("folders", nargs="*", help=f"{folders_help} (default: outputs/study/<name>)")
    ap.add_argument("--results", default=None, help="table folder (default experiments/results/study_<name>)")
    return ap


def _records_study(args: argparse.Namespace):
    """(study, its record folders, its results folder) of a records command, or None after printing the study file's
    error."""
    try:
        study = load_study(args.study)
    except StudyError as e:
        print(f"error: {e}", file=sys.stderr)
        return None
    out, results = _defaults(study.name, None, args.results)
    return study, [Path(f) for f in args.folders] or [out], results


def _merge_main(argv: list[str]) -> int:
    ap = _records_parser(
        "merge",
        "Collect the run records of a study's shards (their --out folders) into one table.",
        "--out folders of the shards",
    )
    loaded = _records_study(ap.parse_args(argv))
    if loaded is None:
        return 2
    study, folders, results = loaded
    for f in folders:
        if not (f / "runs").is_dir():
            print(f"error: {f} holds no runs/ folder; pass the --out folders of the study's shards", file=sys.stderr)
            return 2
    md = merge(study, folders, results)
    print(md.read_text())
    print(f"written to {results}/ (table.md, table.csv, differences.csv, runs.csv)")
    return 0


def _training_main(argv: list[str]) -> int:
    ap = _records_parser(
        "training",
        "The training curves of a study's runs (the zero-variance fraction, tied groups, levels): per row the mean "
        "over steps with a 95%% t interval over seeds, per third, and the seed-paired differences of its "
        "comparisons -> training.md / training.csv.",
        "--out folders of the shards, or a records.tgz unpacked",
    )
    ap.add_argument("--key", action="append", default=None, help=f"a train/* curve, repeatable (default: {KEYS})")
    args = ap.parse_args(argv)
    loaded = _records_study(args)
    if loaded is None:
        return 2
    study, folders, results = loaded
    try:
        md = write_training(study, folders, results, args.key or KEYS)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(md.read_text())
    print(f"written to {results}/ (training.md, training.csv)")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["merge"]:
        return _merge_main(argv[1:])
    if argv[:1] == ["training"]:
        return _training_main(argv[1:])
    ap = argparse.ArgumentParser(
        prog="python -m runner.study",
        description="Train and evaluate a study's rows x seeds: one train.py fit per run, then its held-out "
        "evaluation; -j processes at a time; --shard i/n runs a fixed part; finished runs are skipped.",
        epilog="Then: python -m runner.study merge STUDY [OUT ...] builds the table from the shards' --out folders.",
        allow_abbrev=False,
    )
    ap.add_argument("study", help="a study file, e.g. experiments/study/table1_toy.yaml")
    ap.add_argument("-j", "--jobs", type=int, default=1, help="processes at a time (default 1)")
    ap.add_argument("--shard", default=None, help="i/n: run every n-th run starting at the i-th (1-based)")
    ap.add_argument("--out", default=None, help="run records and logs (default outputs/study/<name>)")
    ap.add_argument("--work", default=None, help="run folders: checkpoints, data (default <out>/work)")
    ap.add_argument("--results", default=None, help="table folder (default experiments/results/study_<name>)")
    ap.add_argument("--dry-run", action="store_true", help="print the runs of this shard and their commands")
    ap.add_argument("--prune", action="store_true", help="delete a run's checkpoints once its record is written")
    ap.add_argument("--online", action="store_true", help="let W&B go online (default: WANDB_MODE=offline)")
    ap.add_argument(
        "--eval-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="a train.py flag added to every evaluation of this call only, repeatable: where it runs, not what it "
        "measures (e.g. --eval-flag=--trainer.accelerator=gpu --eval-flag=--data.init_args.eval_batch_size=128)",
    )
    ap.add_argument(
        "--fit-flag",
        action="append",
        default=[],
        metavar="FLAG",
        help="a train.py flag added to every fit of this call only, repeatable: where it runs, not what it trains "
        "(e.g. --fit-flag=--trainer.accelerator=gpu --fit-flag=--model.init_args.engines.rollout_engine=fast)",
    )
    args = ap.parse_args(argv)
    try:
        study = load_study(args.study)
        study.eval_overrides = [*study.eval_overrides, *args.eval_flag]
        study.fit_flags = list(args.fit_flag)
        i, n = parse_shard(args.shard)
        if args.jobs < 1:
            raise StudyError(f"-j must be >= 1, got {args.jobs}")
    except StudyError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out, results = _defaults(study.name, args.out, args.results)
    runs, data_root = plan(study, out, args.work)
    mine = shard(runs, i, n)
    if args.dry_run:
        for r in mine:
            state = "done" if r.done else "trained" if r.train and r.trained else "to run"
            print(f"# {r.key} ({state})")
            for p in (r.train, r.export, r.evaluate):
                if p is not None:
                    print(" ".join(p.argv))
        return 0

    points: list[Point] = []
    owner: dict[int, Run] = {}
    skipped = 0
    for r in mine:
        owner[id(r.evaluate)] = r
        if r.done:
            skipped += 1
            continue
        if r.train is not None and not r.trained:
            if r.work.exists():  # an unfinished fit (a killed call): start it again from scratch
                shutil.rmtree(r.work)
            r.train.then = r.export or r.evaluate
            points.append(r.train)
        else:
            points.append(r.export or r.evaluate)

    failed: list[Point] = []

    def on_done(p: Point) -> None:
        if p.returncode != 0:
            failed.append(p)
            return
        mark_trained(p)
        run = owner.get(id(p))
        if run is not None:
            write_record(run, study)
            if args.prune:
                shutil.rmtree(run.work / "checkpoints", ignore_errors=True)

    env = {
        "WANDB_RUN_GROUP": study.name,
        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        "MKL_NUM_THREADS": os.environ.get("MKL_NUM_THREADS", "1"),
        "TOKENIZERS_PARALLELISM": "false",
    }
    if not args.online:
        env["WANDB_MODE"] = "offline"
    print(
        f"study {study.name}: {len(runs)} run(s), shard {i}/{n}: {len(mine)} ({skipped} done before), "
        f"{args.jobs} at a time -> {out}/",
        flush=True,
    )
    t0 = time.monotonic()
    if points:
        prepare_data([r for r in mine if not r.done])
        print(f"data ready in {data_root}/ ({time.monotonic() - t0:.0f} s)", flush=True)
    run_points(points, args.jobs, env, on_done=on_done)
    print(f"shard {i}/{n} finished in {time.monotonic() - t0:.0f} s", flush=True)
    for p in failed:
        print(f"error: {p.name} exited with {p.returncode}; its output is in {p.log}", file=sys.stderr)

    left = [r.key for r in runs if not r.done]
    if left:
        print(
            f"{len(left)} run(s) of the study have no record in {out} yet (other shards, or failed ones); when all "
            f"shards are done: python -m runner.study merge {args.study} <each shard's --out>",
            flush=True,
        )
    else:
        md = merge(study, [out], results, out)
        print(md.read_text())
        print(f"written to {results}/ (table.md, table.csv, differences.csv, runs.csv)")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
