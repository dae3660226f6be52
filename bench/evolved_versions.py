"""How a toy checkpoint's groups fare on each version EvolvedGRPO can give a sample (a component analysis: it calls
the rollout directly, not ``train.py``; figures, never asserts).

    python bench/evolved_versions.py [checkpoints/toy-qwen2.5-vl-evolved] [--scenes 96] [--group 6] [--out r.json]

For ``--scenes`` scenes of the toy world's ``train`` split (seed 0; level 0, the question each scene comes with), the
versions of ``datamodules.evolve.evolve``: the original, the sub-problem (decluttered image), the isolated image and
the zoomed one (``ZOOM_KIND``). Each is answered ``--group`` times at temperature 1 with the toy prompt, as a GRPO step
samples a group; per version: Acc@0.5 of the completions and the share of groups all wrong / all right / mixed (the
binary outcome reward's ties, docs/evolved_grpo.md), over all scenes and by the target's size word.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core import rewards  # noqa: E402
from core.toy import scene as toy_scene  # noqa: E402
from datamodules import evolve as ev  # noqa: E402
from datamodules import toy  # noqa: E402
from lightning_modules.engines.base import rollout  # noqa: E402
from lightning_modules.models.loading import load_policy  # noqa: E402

VERSIONS = {
    "original": (ev.Level(0, 0), "isolate"),
    "declutter": (ev.Level(0, 1), "isolate"),
    "isolate": (ev.Level(0, 2), "isolate"),
    "zoom": (ev.Level(0, 2), "zoom"),
}


def evaluate(path: str, scenes: int = 96, group: int = 6, batch: int = 16, seed: int = 0) -> dict:
    torch.manual_seed(seed)
    model, proc = load_policy(path, dtype="fp32")
    records = [toy.make_scene("train", i, seed=0) for i in range(scenes)]
    out: dict = {"checkpoint": path, "scenes": scenes, "group": group}
    for name, (level, easier) in VERSIONS.items():
        items = []  # (image, query, box, size word, the version's kind)
        for i, rec in enumerate(records):
            v = ev.evolve(rec, level, np.random.default_rng([seed, i]), modality="any", easier=easier)
            if v is not None:
                size = v.meta["objects"][toy_scene.target_index(v.meta)]["size"]
                items.append((v.image.convert("RGB"), v.query, v.box, size, v.kind))
        correct = []
        for j in range(0, len(items), batch):
            b = items[j : j + batch]
            r = rollout(model, proc, [x[0] for x in b], [x[1] for x in b], group_size=group, task="rec",
                        template="toy", max_new_tokens=136, temperature=1.0)  # fmt: skip
            ious = rewards.rec_accuracy_reward(
                r.texts, [x[2] for x in b for _ in range(group)], input_wh=r.input_wh,
                orig_wh=[x[0].size for x in b for _ in range(group)],
            )  # fmt: skip
            correct += np.array(ious).reshape(len(b), group).__ge__(0.5).tolist()
        c = np.array(correct, dtype=bool)
        sizes = np.array([x[3] for x in items])
        res = {"n": len(items), "kinds": sorted({x[4] for x in items})}
        for part, m in [("all", np.ones(len(items), bool)), ("small", sizes == "small"), ("large", sizes == "large")]:
            g = c[m]
            res[part] = {
                "groups": int(m.sum()),
                "acc50": round(float(g.mean()) * 100, 1) if m.any() else None,
                "all_wrong": round(float((~g.any(1)).mean()) * 100, 1) if m.any() else None,
                "all_right": round(float(g.all(1).mean()) * 100, 1) if m.any() else None,
            }
        out[name] = res
        print(name, json.dumps(res), flush=True)
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoint", nargs="?", default="checkpoints/toy-qwen2.5-vl-evolved")
    ap.add_argument("--scenes", type=int, default=96)
    ap.add_argument("--group", type=int, default=6)
    ap.add_argument("--out", help="also write the result as JSON here")
    args = ap.parse_args(argv)
    out = evaluate(args.checkpoint, args.scenes, args.group)
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    return out


if __name__ == "__main__":
    main()
