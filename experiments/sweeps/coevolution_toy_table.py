"""Issue 43's toy study table: co-evolution vs plain GRPO (the same answer-model updates), per round, over seeds.

Reads the ``summary.json`` of runs made by
    python -m cli.coevolve --config configs/coevolve/toy.yaml --seed S --out RUNS/coevolve_sS
    python -m cli.coevolve --config configs/coevolve/toy.yaml --seed S --mode plain --out RUNS/plain_sS
and prints a markdown table: A's held-out greedy accuracy after each round (mean and 95% t interval over seeds,
runner.stats.t_interval), the paired difference co-evolution - plain per seed, and Q's valid / harder edit rates.
    python experiments/sweeps/coevolution_toy_table.py RUNS > table.md
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from runner.stats import t_interval  # noqa: E402


def fmt(values: list[float], pct: bool = True) -> str:
    if not values:
        return "-"
    iv = t_interval(values)
    k = 100 if pct else 1
    if iv.kind == "none":
        return f"{iv.mean * k:.1f} (n=1)"
    return f"{iv.mean * k:.1f} [{iv.lo * k:.1f}, {iv.hi * k:.1f}] (n={iv.n})"


def main(root: str) -> None:
    runs = {}
    for f in sorted(Path(root).glob("*_s*/summary.json")):
        mode, seed = f.parent.name.rsplit("_s", 1)
        runs[(mode, int(seed))] = json.loads(f.read_text())
    seeds = sorted({s for m, s in runs if m == "coevolve"} & {s for m, s in runs if m == "plain"})
    rounds = max((len(r["per_round"]) for r in runs.values()), default=0)
    print(
        "| round | split | plain GRPO | co-evolution | co-evolution - plain (paired) | Q valid edits | Q harder edits |"
    )
    print("| --- | --- | ---: | ---: | ---: | ---: | ---: |")
    for k in range(rounds):
        for split in ("toy_math_val", "toy_math_ood"):
            key = f"test/{split}/accuracy"
            plain = [runs[("plain", s)]["per_round"][k]["answer_eval"][key] for s in seeds]
            coev = [runs[("coevolve", s)]["per_round"][k]["answer_eval"][key] for s in seeds]
            diff = [c - p for c, p in zip(coev, plain)]
            valid = [runs[("coevolve", s)]["per_round"][k]["valid_edit_rate"] for s in seeds]
            harder = [runs[("coevolve", s)]["per_round"][k]["harder_edit_rate"] for s in seeds]
            edits = split == "toy_math_val"
            print(f"| {k + 1} | {split} | {fmt(plain)} | {fmt(coev)} | {fmt(diff)} | "
                  f"{fmt(valid) if edits else ''} | {fmt(harder) if edits else ''} |")  # fmt: skip
    print(f"\nseeds: {seeds}")


if __name__ == "__main__":
    main(sys.argv[1])
