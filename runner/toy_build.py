"""Build the toy base's SFT stages in order, resumably (``make toy-base``; docs/toy_model.md, "A base that has not
seen the RL task").

    python -m runner.toy_build [--precision 32-true|bf16-mixed] [--only STAGE ...] [--force] [-- TRAIN.PY FLAGS]

Each stage is ``python train.py fit --config configs/toy_sft.yaml --config configs/toy_sft_stage_base{,2,3,4}.yaml``.
A stage whose model directory holds this builder's ``BUILD`` record for the same configs is done and skipped; a stage
stopped part-way (killed, out of time, a device call's limit) continues from its run's newest checkpoint
(``outputs/toy_sft-base<k>/checkpoints/last.ckpt``, written every 200 steps); otherwise it starts. So the build can
stop at any point and the same command continues it (a device call's limit, a session's end); docs/toy_model.md gives
the measured times of both stages on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SFT = "configs/toy_sft.yaml"
"""Every stage's first config (the toy SFT setting and the model's shape); the stage's own config follows it."""


@dataclass(frozen=True)
class Stage:
    name: str
    config: str
    """The stage's config, composed on ``SFT``."""
    model_dir: str
    """The stage's ``export_dir`` (its config's): the next stage starts from it."""

    @property
    def configs(self) -> tuple[str, str]:
        return (SFT, self.config)

    @property
    def run_dir(self) -> Path:
        return ROOT / "outputs" / f"toy_sft-{self.name}"  # toy_sft.yaml's name, the stage config's method


STAGES = (
    Stage("base1", "configs/toy_sft_stage_base.yaml", "outputs/toy_base/stage1"),
    Stage("base2", "configs/toy_sft_stage_base2.yaml", "outputs/toy_base/stage2"),
    Stage("base3", "configs/toy_sft_stage_base3.yaml", "outputs/toy_base/stage3"),
    Stage("base4", "configs/toy_sft_stage_base4.yaml", "outputs/toy_base/stage4"),
)


def record_path(stage: Stage) -> Path:
    return ROOT / stage.model_dir / "BUILD"


def is_built(stage: Stage) -> bool:
    """Whether ``stage``'s model directory holds the record this builder writes when the stage's fit ends."""
    try:
        return json.loads(record_path(stage).read_text()).get("configs") == list(stage.configs)
    except (OSError, ValueError):
        return False


def command(stage: Stage, precision: str, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "train.py", "fit"]
    for c in stage.configs:
        cmd += ["--config", c]
    cmd += ["--trainer.precision", precision]
    last = stage.run_dir / "checkpoints" / "last.ckpt"
    if last.is_file() and not is_built(stage):  # stopped part-way: continue in its run folder
        cmd += ["--ckpt_path", str(last.relative_to(ROOT))]
    return cmd + extra


def build(stages: list[Stage], precision: str, extra: list[str], force: bool = False) -> int:
    todo = [s for s in stages if force or not is_built(s)]
    if not todo:
        print(f"toy base: every stage is built ({', '.join(s.model_dir for s in stages)}); --force rebuilds")
        return 0
    for stage in stages:
        if stage not in todo:
            print(f"toy base {stage.name}: built ({stage.model_dir}/BUILD), skipped")
            continue
        cmd = command(stage, precision, extra)
        print(f"toy base {stage.name}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.time()
        rc = subprocess.call(cmd, cwd=ROOT)
        if rc != 0:
            print(
                f"toy base {stage.name}: train.py exited {rc}; run the same command again to continue from "
                f"{stage.run_dir.relative_to(ROOT)}/checkpoints/last.ckpt",
                file=sys.stderr,
            )
            return rc
        record = {
            "stage": stage.name,
            "configs": list(stage.configs),
            "precision": precision,
            "extra_flags": extra,
            "seconds": round(time.time() - t0, 1),
            "date": time.strftime("%Y-%m-%d"),
        }
        record_path(stage).write_text(json.dumps(record, indent=1) + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--precision", default=None, help="default: bf16-mixed with a GPU, else 32-true")
    ap.add_argument("--only", nargs="*", choices=[s.name for s in STAGES], help="these stages only, in order")
    ap.add_argument("--force", action="store_true", help="rebuild stages that are built")
    args = ap.parse_args(argv)
    if args.precision is None:
        import torch

        args.precision = "bf16-mixed" if torch.cuda.is_available() else "32-true"
    stages = [s for s in STAGES if not args.only or s.name in args.only]
    return build(stages, args.precision, extra, force=args.force)


if __name__ == "__main__":
    sys.exit(main())
