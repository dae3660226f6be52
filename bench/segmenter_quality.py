"""Foreground segmenter quality against the toy world's exact object masks (issue 41, the segmenter).

    OMP_NUM_THREADS=1 python bench/segmenter_quality.py [--scenes 200] [--size 224] [--sam2-path DIR]
        [--device cpu] [--out experiments/results/segmenter_quality_cpu.json]

Each toy REC scene (``datamodules.toy.make_scene``, split ``train``) knows its objects' shapes, so the pixels of the
target that show in the image are known exactly (``core.toy.scene.owner_map`` equal to the target's index: its shape,
less what an occluder covers). Every masker gets the image and the target's labelled box, as the data server gives
it, and its mask (``synth.foreground.keep_mask``: clipped to the box) is scored against those pixels:

* ``iou``: mask IoU (mean and median over scenes);
* ``recall``: the share of the target's pixels kept (what the painter must not touch: below 1, part of the labelled
  object is repainted);
* ``precision``: the share of kept pixels that are the target's (the rest is background pasted into the new scene);
* ``ms``: wall time per image (one thread).

``box`` (the whole box) is the floor, ``grabcut`` (OpenCV, no weights) the baseline; ``sam2`` is measured when
``--sam2-path`` names a transformers SAM 2 checkpoint folder (``huggingface-cli download facebook/sam2.1-hiera-large
--local-dir DIR`` on a machine with internet); without one the JSON records it as a gap.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core.toy.scene import owner_map, target_index  # noqa: E402
from datamodules.toy import make_scene  # noqa: E402
from synth.foreground import build_masker, keep_mask, load_masker  # noqa: E402


def scenes(n: int, size: int, seed: int) -> list[tuple[np.ndarray, list[float], np.ndarray]]:
    """``(image uint8 [H, W, 3], target box, visible target pixels bool [H, W])`` for ``n`` toy REC scenes."""
    out = []
    for i in range(n):
        rec = make_scene("train", i, seed=seed, size=size)
        meta = rec["meta"]
        idx = target_index(meta)
        truth = owner_map(meta) == idx
        out.append((np.asarray(rec["image"].convert("RGB")), [float(v) for v in meta["objects"][idx]["box"]], truth))
    return out


def score(masker, data) -> dict[str, float]:
    ious, recalls, precisions, times = [], [], [], []
    keep_mask(masker, data[0][0], [data[0][1]])  # untimed: lazy imports, first-call kernels
    for image, box, truth in data:
        t0 = time.perf_counter()
        kept = keep_mask(masker, image, [box])
        times.append(time.perf_counter() - t0)
        inter = float((kept & truth).sum())
        ious.append(inter / max(1.0, float((kept | truth).sum())))
        recalls.append(inter / max(1.0, float(truth.sum())))
        precisions.append(inter / max(1.0, float(kept.sum())))
    return {
        "iou_mean": round(statistics.mean(ious), 4),
        "iou_median": round(statistics.median(ious), 4),
        "recall_mean": round(statistics.mean(recalls), 4),
        "recall_min": round(min(recalls), 4),
        "precision_mean": round(statistics.mean(precisions), 4),
        "ms_per_image": round(1000 * statistics.median(times), 2),
        "fallbacks": int(getattr(masker, "fallbacks", 0)),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenes", type=int, default=200, help="toy REC scenes (train split, indices 0..N-1)")
    ap.add_argument("--size", type=int, default=224, help="scene side in pixels")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sam2-path", default=None, help="a transformers SAM 2 checkpoint folder (measures sam2)")
    ap.add_argument("--device", default="cpu", help="device of the sam2 masker")
    ap.add_argument("--out", default=None, help="write the JSON record here")
    args = ap.parse_args(argv)

    data = scenes(args.scenes, args.size, args.seed)
    maskers = {"box": build_masker("box"), "grabcut": build_masker("grabcut")}
    if args.sam2_path:
        maskers["sam2"] = load_masker(build_masker("sam2", path=args.sam2_path, device=args.device))
    rows = {name: score(m, data) for name, m in maskers.items()}

    print(
        f"{len(data)} toy REC scenes, {args.size} px, seed {args.seed} (mask IoU against the target's visible pixels)"
    )
    print(f"{'masker':8} {'IoU mean':>9} {'median':>7} {'recall':>7} {'min':>6} {'precision':>9} {'ms/img':>7}")
    for name, r in rows.items():
        print(
            f"{name:8} {r['iou_mean']:9.3f} {r['iou_median']:7.3f} {r['recall_mean']:7.3f} {r['recall_min']:6.3f} "
            f"{r['precision_mean']:9.3f} {r['ms_per_image']:7.1f}"
        )
    if not args.sam2_path:
        print("sam2: not measured (no --sam2-path: no SAM 2 weights on this machine)")
    if args.out:
        record = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "machine": {
                "platform": platform.platform(),
                "python": platform.python_version(),
                "cpus": os.cpu_count(),
                "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
                "device": args.device if args.sam2_path else None,
            },
            "command": " ".join([Path(sys.executable).name, *sys.argv]),
            "scenes": {"count": len(data), "split": "train", "task": "rec", "size": args.size, "seed": args.seed},
            "truth": "core.toy.scene.owner_map == target index (the target's shape pixels that show)",
            "results": rows,
            "gaps": []
            if args.sam2_path
            else ["sam2: no SAM 2 weights on this machine (no internet); run with --sam2-path where they exist"],
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
