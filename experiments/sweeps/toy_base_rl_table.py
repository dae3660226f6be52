"""Issue 58: the table of experiments/sweeps/toy_base_rl.sh's runs: each run's held-out greedy Acc@0.5 (start, end;
callbacks/heldout.py's results/heldout.json) and the differences, mean [95% t interval over seeds], in points.

    python experiments/sweeps/toy_base_rl_table.py OUT_DIR [--json result.json]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from runner.stats import t_interval  # noqa: E402

LABELS = {"syn": "Syn-GRPO", "grpo": "GRPO", "sft": "SFT continued"}


def load(root: Path) -> dict[str, dict[int, dict]]:
    runs: dict[str, dict[int, dict]] = {}
    for f in sorted(root.glob("*_s*/results/heldout.json")):
        method, seed = f.parts[-3].rsplit("_s", 1)
        runs.setdefault(method, {})[int(seed)] = json.loads(f.read_text())
    return runs


def acc(h: dict, split: str, when: str) -> float:
    """Greedy Acc@0.5 in points of held-out record ``h`` at the fit's ``start`` or ``end``."""
    return 100.0 * h["start" if when == "start" else "final"][split]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("root")
    ap.add_argument("--json")
    args = ap.parse_args()
    runs = load(Path(args.root))
    out: dict = {"runs": {}, "differences": {}}
    print(f"{'run':<24} {'val start':>9} {'val end':>8} {'ood start':>9} {'ood end':>8}")
    for m, seeds in runs.items():
        for s, h in sorted(seeds.items()):
            row = {sp: (acc(h, sp, "start"), acc(h, sp, "end")) for sp in ("val", "ood")}
            out["runs"][f"{m}_s{s}"] = row
            print(
                f"{LABELS.get(m, m) + f' seed {s}':<24} {row['val'][0]:9.1f} {row['val'][1]:8.1f} "
                f"{row['ood'][0]:9.1f} {row['ood'][1]:8.1f}"
            )
    pairs = [(m, None) for m in runs] + [("syn", "grpo"), ("grpo", "sft")]
    for a, b in pairs:
        if a not in runs or (b is not None and b not in runs):
            continue
        for sp in ("val", "ood"):
            seeds = sorted(set(runs[a]) & set(runs[b] if b else runs[a]))
            if b is None:
                d = [acc(runs[a][s], sp, "end") - acc(runs[a][s], sp, "start") for s in seeds]
                name = f"{LABELS[a]} - start"
            else:
                d = [acc(runs[a][s], sp, "end") - acc(runs[b][s], sp, "end") for s in seeds]
                name = f"{LABELS[a]} - {LABELS[b]}"
            iv = t_interval(d)
            out["differences"][f"{name} ({sp})"] = {"seeds": seeds, "values": d, "mean": iv.mean, "t95": [iv.lo, iv.hi]}
            shown = f"[{iv.lo:+.1f}, {iv.hi:+.1f}]" if iv.kind == "t" else "(one seed)"
            print(f"{name + f' ({sp})':<36} {sum(d) / len(d):+5.1f} {shown}  seeds {seeds}")
    if args.json:
        head = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} ({os.cpu_count()} cpus)"}
        head["command"] = "python " + " ".join(sys.argv)
        Path(args.json).write_text(json.dumps({**head, **out}, indent=1) + "\n")


if __name__ == "__main__":
    main()
