"""Wall time of the reward text handling on runaway completions (issue "Data server and reward boundaries").

    OMP_NUM_THREADS=1 python bench/reward_speed.py [--boxes 10000] [--depth 5000] [--reps 7] [--target-ms 50]
        [--out experiments/results/reward_speed.json]

The issue's target is < 50 ms per completion at 10,000 boxes: a benchmark figure, not a timed test (tests only check
that nothing raises). Timed, each on one completion (the full four-part syn_grpo form):

* ``json``: the answer is VLM-R1 / Qwen2.5-VL JSON, a ```json fenced list of ``{"bbox_2d": [...], "label": ...}``
  objects, ``--boxes`` of them (read by ``json.loads``);
* ``plain``: the answer is ``--boxes`` plain lists ``[x1, y1, x2, y2], [...]`` separated by commas (not one JSON
  value: read by the regex salvage);
* ``nested``: a TRL conversational completion nested ``--depth`` lists deep, whose answer is also ``--depth``
  brackets deep (``json.loads`` gives up with RecursionError; the salvage reads the box inside).

Functions: ``extract_boxes`` (on the answer text), ``parse_completion``, ``rec_accuracy_reward`` and ``ovd_reward``
(one completion, 5 ground-truth boxes; the metric scores the first ``MAX_PRED_BOXES`` predictions but parsing reads
them all). Reported: the median and the minimum over ``--reps`` calls, after one untimed call (the mAP metric's import
takes seconds once per process).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core.rewards import (  # noqa: E402 - after the path set-up
    extract_boxes,
    ovd_reward,
    parse_completion,
    rec_accuracy_reward,
)


def _completion(answer: str) -> str:
    return f"<think>Listing every car.</think><diversity>0.4</diversity><description>a street</description><answer>{answer}</answer>"


def _cases(n_boxes: int, depth: int) -> dict[str, tuple[object, str]]:
    """name -> (completion, its answer text)."""
    rng = random.Random(0)
    boxes = []
    for _ in range(n_boxes):
        x1, y1 = rng.randint(0, 900), rng.randint(0, 900)
        boxes.append([x1, y1, x1 + rng.randint(5, 100), y1 + rng.randint(5, 100)])
    as_json = "```json\n" + json.dumps([{"bbox_2d": b, "label": "car"} for b in boxes], indent=2) + "\n```"
    plain = ", ".join(str(b) for b in boxes)
    nested_answer = "[" * depth + "10, 20, 110, 220" + "]" * depth
    nested: object = {"role": "assistant", "content": _completion(nested_answer)}
    for _ in range(depth):
        nested = [nested]
    return {
        f"json {n_boxes} boxes": (_completion(as_json), as_json),
        f"plain {n_boxes} boxes": (_completion(plain), plain),
        f"nested {depth} deep": (nested, nested_answer),
    }


def _time(fn, reps: int) -> tuple[float, float]:
    fn()  # untimed: imports, caches
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, min(times) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--boxes", type=int, default=10_000, help="boxes in the json and plain completions")
    ap.add_argument("--depth", type=int, default=5_000, help="nesting depth of the nested completion")
    ap.add_argument("--reps", type=int, default=7, help="timed calls per figure (median reported)")
    ap.add_argument("--target-ms", type=float, default=50.0)
    ap.add_argument("--out", default=None, help="also write the figures as JSON here")
    args = ap.parse_args(argv)

    gt = [[10, 20, 110, 220], [300, 300, 380, 360], [500, 100, 560, 180], [50, 600, 150, 700], [700, 700, 800, 790]]
    rows = []
    print(f"{'completion':<20} {'function':<20} {'chars':>9} {'boxes':>6} {'median ms':>10} {'min ms':>8}  target")
    for case, (completion, answer) in _cases(args.boxes, args.depth).items():
        n_chars = len(answer)
        n_found = len(parse_completion(completion).boxes)
        fns = {
            "extract_boxes": lambda a=answer: extract_boxes(a),
            "parse_completion": lambda c=completion: parse_completion(c),
            "rec_accuracy_reward": lambda c=completion: rec_accuracy_reward([c], gt[0]),
            "ovd_reward": lambda c=completion: ovd_reward([c], gt),
        }
        for name, fn in fns.items():
            med, best = _time(fn, args.reps)
            ok = med < args.target_ms
            rows.append({"completion": case, "function": name, "chars": n_chars, "boxes": n_found,
                         "median_ms": round(med, 2), "min_ms": round(best, 2), "under_target": ok})  # fmt: skip
            verdict = f"{'<' if ok else '>='} {args.target_ms:g} ms"
            print(f"{case:<20} {name:<20} {n_chars:>9} {n_found:>6} {med:>10.1f} {best:>8.1f}  {verdict}")
    print(f"({args.reps} reps; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, python "
          f"{platform.python_version()}, {os.cpu_count()} CPUs)")  # fmt: skip

    if args.out:
        record = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "target_ms": args.target_ms,
            "rows": rows,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
