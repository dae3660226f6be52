"""Seconds per epoch of the tiny config with synthesis off / async / sync (the shape of the paper's Table 5).

    python bench/synthesis_overhead.py [--epochs 3] [--train 32] [--out experiments/results/synthesis_overhead_cpu.json]

Each mode runs the same seeded fit (toy checkpoint, toy world, procedural painter on a local server). An epoch is
timed from its start to the start of the next one, so the epoch-boundary swap (and, in sync mode, the wait) is
inside it. The async overhead over off is reported as a ratio; the goal at tiny scale is at most 5%.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from datetime import date
from pathlib import Path

import lightning as L

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from train import cli_main  # noqa: E402


class EpochTimer(L.Callback):
    def __init__(self):
        self.starts: list[float] = []
        self.end = 0.0

    def on_train_epoch_start(self, trainer, pl_module):
        self.starts.append(time.perf_counter())

    def on_train_end(self, trainer, pl_module):
        self.end = time.perf_counter()

    def epochs(self) -> list[float]:
        marks = self.starts + [self.end]
        return [b - a for a, b in zip(marks, marks[1:])]


def run(mode: str, args) -> dict:
    out = Path(args.workdir) / mode
    callbacks = [
        {"class_path": "callbacks.synthesis.SynthesisCallback", "init_args": {"mode": mode, "gallery_samples": 0}}
    ]
    cli = cli_main(
        [
            "--config",
            str(REPO / "configs/tiny.yaml"),
            "--trainer.max_epochs",
            str(args.epochs),
            "--trainer.logger",
            "false",
            "--trainer.callbacks",
            json.dumps(callbacks),
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.limit_val_batches",
            "0",
            "--trainer.default_root_dir",
            str(out),
            "--data.init_args.toy.splits",
            json.dumps({"train": args.train}),
            "--data.init_args.data_root",
            str(Path(args.workdir) / "data"),
            "--data.init_args.val_files",
            "{}",
        ],
        run=False,
    )
    timer = EpochTimer()
    cli.trainer.callbacks.append(timer)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    synth = next(c for c in cli.trainer.callbacks if type(c).__name__ == "SynthesisCallback")
    return {
        "mode": mode,
        "epoch_s": timer.epochs(),
        "totals": synth.totals,
        "swapped": cli.datamodule.pool.num_swapped() if cli.datamodule.pool else 0,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--train", type=int, default=32, help="training samples")
    ap.add_argument("--modes", nargs="+", default=["off", "async", "sync"])
    ap.add_argument("--workdir", default="outputs/bench_synthesis")
    ap.add_argument("--out", default=None, help="write the JSON result here")
    args = ap.parse_args(argv)
    rows = [run(m, args) for m in args.modes]
    # the first epoch carries one-off costs (server start, caches); compare the rest when there is a rest
    for r in rows:
        later = r["epoch_s"][1:] or r["epoch_s"]
        r["mean_epoch_s"] = sum(later) / len(later)
    by = {r["mode"]: r for r in rows}
    result = {
        "date": date.today().isoformat(),
        "machine": f"{platform.machine()}, {platform.processor() or 'cpu'}",
        "command": "python bench/synthesis_overhead.py " + " ".join(argv or sys.argv[1:]),
        "rows": rows,
    }
    if "off" in by and "async" in by:
        result["async_over_off"] = by["async"]["mean_epoch_s"] / by["off"]["mean_epoch_s"]
    if "off" in by and "sync" in by:
        result["sync_over_off"] = by["sync"]["mean_epoch_s"] / by["off"]["mean_epoch_s"]
    print(f"{'mode':<6} {'s/epoch (epochs 2+)':>20} {'epochs':>30} {'swapped':>8}")
    for r in rows:
        print(
            f"{r['mode']:<6} {r['mean_epoch_s']:>20.2f} {str([round(x, 1) for x in r['epoch_s']]):>30} "
            f"{r['swapped']:>8}"
        )
    for k in ("async_over_off", "sync_over_off"):
        if k in result:
            print(f"{k}: {result[k]:.3f}")
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
