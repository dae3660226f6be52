"""Measure a toy checkpoint the way docs/toy_model.md reports it (figures, never asserts).

    python bench/toy_model_eval.py [checkpoints/toy-qwen2.5-vl] [--scenes 64] [--samples 4] [--out result.json]

For the in-domain ``val`` and the ``ood`` split of the toy world (seed 0, the scenes the SFT and GRPO configs
validate on): greedy Acc@0.5 and mean IoU, and over ``--samples`` completions per prompt at temperature 1 the format
rate (what GRPO starts from), mean IoU, Acc@0.5 and the share of completions whose box overlaps the target.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core import rewards  # noqa: E402
from datamodules import toy  # noqa: E402
from datamodules.rec import load_sample, read_jsonl  # noqa: E402
from lightning_modules.engines.base import rollout  # noqa: E402
from lightning_modules.models.loading import load_policy  # noqa: E402


def evaluate(path: str, scenes: int = 64, samples: int = 4, batch: int = 32, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model, proc = load_policy(path, dtype="fp32")
    with tempfile.TemporaryDirectory(prefix="toy-eval-") as tmp:
        data = Path(tmp)
        out: dict = {"checkpoint": path, "scenes": scenes, "samples": samples}
        for split in ("val", "ood"):
            ss = [load_sample(r) for r in read_jsonl(toy.export_jsonl(data, split, scenes, seed=0))]
            greedy, fmt, sampled = [], [], []
            for i in range(0, len(ss), batch):
                b = ss[i : i + batch]
                kw = dict(task=[s.task for s in b], template="toy", max_new_tokens=112)
                ims, qs = [s.image for s in b], [s.query for s in b]
                g = rollout(model, proc, ims, qs, group_size=1, do_sample=False, **kw)
                sm = rollout(model, proc, ims, qs, group_size=samples, do_sample=True, temperature=1.0, **kw)
                gts, orig = [s.boxes[0] for s in b], [s.size for s in b]
                greedy += rewards.rec_accuracy_reward(g.texts, gts, input_wh=g.input_wh, orig_wh=orig)
                fmt += rewards.format_reward(sm.texts)
                sampled += rewards.rec_accuracy_reward(
                    sm.texts,
                    [x for x in gts for _ in range(samples)],
                    input_wh=sm.input_wh,
                    orig_wh=[x for x in orig for _ in range(samples)],
                )
            g_, s_ = np.array(greedy), np.array(sampled)
            out[split] = {
                "greedy_acc50": float((g_ >= 0.5).mean()),
                "greedy_miou": float(g_.mean()),
                "sampled_format": float(np.mean(fmt)),
                "sampled_miou": float(s_.mean()),
                "sampled_acc50": float((s_ >= 0.5).mean()),
                "sampled_iou_nonzero": float((s_ > 0).mean()),
            }
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", nargs="?", default="checkpoints/toy-qwen2.5-vl")
    ap.add_argument("--scenes", type=int, default=64)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--out", help="also write the result as JSON here")
    args = ap.parse_args(argv)
    res = evaluate(args.checkpoint, args.scenes, args.samples)
    for split in ("val", "ood"):
        r = res[split]
        print(
            f"{split:>4}: greedy Acc@0.5 {r['greedy_acc50']:.3f} mIoU {r['greedy_miou']:.3f} | sampled (T=1, "
            f"x{args.samples}) format {r['sampled_format']:.3f} mIoU {r['sampled_miou']:.3f} "
            f"IoU>0 {r['sampled_iou_nonzero']:.3f}"
        )
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
