"""Which product files one GRPO training step visits, and whether it re-enters the module (a component probe, not a
timing: it counts files, not seconds).

Runs ``train.py fit --config configs/tiny.yaml`` (or ``--config``) for one step in process, with a profiler hook active
only inside ``GRPOModule.training_step``. Prints every product file a Python call lands in (in first-visit order,
with the number of calls), and every call back into ``lightning_modules/grpo/module.py`` made from another product
file while ``training_step`` is on the stack (a "re-entry": a method or engine calling the module back).

    OMP_NUM_THREADS=1 python bench/step_trace.py [--config configs/tiny.yaml] [--method syn_grpo]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PRODUCT = ("core", "synth", "datamodules", "lightning_modules", "callbacks", "cli")
MODULE = "lightning_modules/grpo/module.py"


def _product(filename: str) -> str | None:
    try:
        rel = Path(filename).resolve().relative_to(REPO).as_posix()
    except ValueError:
        return None
    return rel if rel.split("/", 1)[0] in PRODUCT else None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--method", default=None, help="--model.init_args.method for the traced run")
    args = parser.parse_args(argv)

    from lightning_modules.grpo import GRPOModule
    from train import cli_main

    calls: collections.Counter[str] = collections.Counter()
    order: list[str] = []
    reentries: collections.Counter[str] = collections.Counter()

    def profile(frame, event, arg):
        if event != "call":
            return
        rel = _product(frame.f_code.co_filename)
        if rel is None:
            return
        if rel not in calls:
            order.append(rel)
        calls[rel] += 1
        if rel == MODULE and frame.f_code.co_name != "training_step":
            caller = frame.f_back
            while caller is not None and _product(caller.f_code.co_filename) is None:
                caller = caller.f_back
            via = _product(caller.f_code.co_filename) if caller is not None else None
            if via is not None and via != MODULE:
                reentries[f"{frame.f_code.co_name} <- {via}"] += 1

    original = GRPOModule.training_step

    def traced(self, *a, **k):
        sys.setprofile(profile)
        try:
            return original(self, *a, **k)
        finally:
            sys.setprofile(None)

    GRPOModule.training_step = traced
    with tempfile.TemporaryDirectory(prefix="step-trace-") as tmp:
        flags = [
            "fit",
            "--config",
            args.config,
            "--trainer.max_steps=1",
            "--trainer.limit_val_batches=0",
            "--trainer.num_sanity_val_steps=0",
            "--callbacks.synthesis.init_args.mode=off",
            f"--trainer.default_root_dir={tmp}",
        ]
        if args.method:
            flags.append(f"--model.init_args.method={args.method}")
        cli_main(flags)
    GRPOModule.training_step = original

    print(f"one training_step of {args.config}{' (' + args.method + ')' if args.method else ''}:")
    print(f"{len(order)} product files visited")
    for rel in order:
        print(f"  {calls[rel]:6d} calls  {rel}")
    total = sum(reentries.values())
    print(f"{total} calls back into {MODULE} from other product files")
    for k, n in reentries.most_common():
        print(f"  {n:6d}  {k}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    sys.exit(main())
