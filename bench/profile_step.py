"""Where a GRPO step's time goes: ``train.py fit`` of a config for a few steps under ``torch.profiler``.

Runs the config in process through the CLI (what a user runs, synthesis included unless a flag removes it), skips
``--warmup`` steps (compilation, CUDA graph capture, the allocator's first growth) and profiles the next ``--steps``.
Writes a Chrome trace (open it in ``chrome://tracing`` or Perfetto) and a JSON of the top costs with their share of the
step: by the module's timing spans (``train/time/*_s``: rollout, rewards, reference, update, optimizer) and by op
(torch.profiler's self time: device time on a GPU, CPU time otherwise).

    OMP_NUM_THREADS=1 python bench/profile_step.py --config configs/rec_3b_1gpu.yaml --steps 3 --warmup 2 \\
        --out experiments/profile/rec_3b_1gpu.json [-- any train.py flag ...]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import lightning as L  # noqa: E402
import torch  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from cli.main import SynGRPOCLI  # noqa: E402


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class StepProfiler(L.Callback):
    """Profiles the training steps after the first ``warmup`` ones, timing each (wall, synchronised) and keeping the
    module's logged ``train/time/*`` spans of each profiled step."""

    def __init__(self, warmup: int) -> None:
        self.warmup = warmup
        self.prof: profile | None = None
        self.step_s: list[float] = []
        self.spans: list[dict[str, float]] = []
        self._seen = 0
        self._t0 = 0.0

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if self._seen == self.warmup and self.prof is None:
            activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
            self.prof = profile(activities=activities, record_shapes=False, with_stack=False)
            self.prof.__enter__()
        _sync()
        self._t0 = time.perf_counter()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        _sync()
        wall = time.perf_counter() - self._t0
        self._seen += 1
        if self.prof is None:
            return
        self.step_s.append(wall)
        metrics = trainer.callback_metrics
        self.spans.append({k: float(v) for k, v in metrics.items() if k.startswith("train/time/")})

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.prof is not None:
            self.prof.__exit__(None, None, None)


KERNEL_KINDS = (  # (kind, substrings of a device kernel's name), first match wins
    ("attention", ("flash", "fmha", "attention", "attn")),
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "splitk")),
    ("copy / cast", ("memcpy", "memset", "copy", "cast", "convert")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("normalisation", ("norm",)),
    ("reduction", ("reduce", "softmax", "sum", "cumsum", "scan")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "triton")),
)


def kernel_kinds(events, n_steps: int, step: float) -> list[dict[str, Any]]:
    """Device kernels only (no CPU op, so nothing is counted twice), grouped by the kind their name says."""
    totals: dict[str, float] = {}
    for e in events:
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA or e.self_device_time_total <= 0:
            continue
        name = e.key.lower()
        kind = next((k for k, keys in KERNEL_KINDS if any(x in name for x in keys)), "other")
        totals[kind] = totals.get(kind, 0.0) + e.self_device_time_total / 1e6 / n_steps
    rows = [{"kind": k, "s": round(v, 4), "share": round(v / step, 4)} for k, v in totals.items()]
    busy = sum(totals.values())
    rows.append(
        {"kind": "GPU idle (step - kernel time)", "s": round(step - busy, 4), "share": round(1 - busy / step, 4)}
    )
    return sorted(rows, key=lambda r: -r["s"])


def summarise(p: StepProfiler, top: int) -> dict[str, Any]:
    """The step times, the spans and the top ops, each with its share of the mean profiled step."""
    if not p.step_s:
        raise SystemExit("no step was profiled: raise --steps, or lower --warmup below the run's step count")
    step = statistics.mean(p.step_s)
    spans = []
    for key in sorted({k for s in p.spans for k in s}):
        mean = statistics.mean(s.get(key, 0.0) for s in p.spans)
        spans.append({"name": key, "s": round(mean, 6), "share": round(mean / step, 4)})
    spans.sort(key=lambda r: -r["s"])
    device = torch.cuda.is_available()
    events = p.prof.key_averages()
    ops = []
    for e in events:
        self_us = e.self_device_time_total if device else e.self_cpu_time_total
        if self_us <= 0:
            continue
        per_step = self_us / 1e6 / len(p.step_s)
        ops.append({"op": e.key, "calls": e.count // len(p.step_s), "self_s": round(per_step, 6)})
    ops.sort(key=lambda r: -r["self_s"])
    for r in ops:
        r["share"] = round(r["self_s"] / step, 4)
    return {
        "step_s": [round(s, 4) for s in p.step_s],
        "mean_step_s": round(step, 4),
        "spans": spans,
        "ops_by": "self device time" if device else "self CPU time",
        "ops": ops[:top],
        **({"kernel_kinds": kernel_kinds(events, len(p.step_s), step)} if device else {}),
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default="configs/tiny.yaml")
    parser.add_argument("--steps", type=int, default=3, help="steps profiled")
    parser.add_argument("--warmup", type=int, default=1, help="steps run before profiling")
    parser.add_argument("--top", type=int, default=25, help="ops listed")
    parser.add_argument("--out", default="experiments/profile/profile.json")
    parser.add_argument(
        "--trace", default=None, help="the Chrome trace (default: --out with .trace.json; 'none': not written)"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    trace = Path(args.trace) if args.trace else out.with_suffix(".trace.json")
    out.parent.mkdir(parents=True, exist_ok=True)

    profiler = StepProfiler(args.warmup)
    flags = [
        "fit",
        "--config",
        args.config,
        f"--trainer.max_steps={args.warmup + args.steps}",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        *extra,
    ]
    SynGRPOCLI(args=flags, trainer_defaults={"callbacks": [profiler]})
    result = {
        "config": args.config,
        "flags": flags[1:],
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "date": datetime.date.today().isoformat(),
        "warmup": args.warmup,
        "steps": len(profiler.step_s),
        **summarise(profiler, args.top),
        "trace": str(trace) if args.trace != "none" else None,
    }
    if args.trace != "none":
        profiler.prof.export_chrome_trace(str(trace))
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(
        f"{args.config}: {result['steps']} steps profiled, mean {result['mean_step_s']:.3f} s/step on {result['device']}"
    )
    for r in result["spans"]:
        print(f"  {r['share']:6.1%}  {r['s']:8.3f} s  {r['name']}")
    print(f"top ops by {result['ops_by']}:")
    for r in result["ops"][:15]:
        print(f"  {r['share']:6.1%}  {r['self_s']:8.4f} s  {r['calls']:6d}x  {r['op']}")
    for r in result.get("kernel_kinds", []):
        print(f"  {r['share']:6.1%}  {r['s']:8.4f} s  kernels: {r['kind']}")
    print(f"wrote {out} and {trace}")
    return result


if __name__ == "__main__":
    os.environ.setdefault("WANDB_MODE", "offline")
    main()
