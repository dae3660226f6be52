"""How much of RL's task the toy base's SFT mix holds (issue 58; docs/toy_model.md, "A base that has not seen the RL task"): it should be none.

    python bench/toy_base_overlap.py [--scenes 5000] [--out result.json]

Reads the first ``--scenes`` training samples of each stage's mix (``configs/toy_sft_stage_base{,2}.yaml``: the
``base``, ``base_varied`` and ``base_solo`` splits, a quarter of them captioning samples) against as many scenes of each split RL trains and is
measured on (``train``, ``val``, ``ood``; seed 0) and prints, each of which should be 0:

* **query kind**: base samples whose query (or, for a captioning sample, whose answer) names two or more of size,
  colour and shape; RL asks all three ("the small red circle");
* **query texts**: distinct base query texts that are also RL query texts;
* **targets**: base completions (the ``toy_base`` target, or a caption's answer) that contain an RL query text, so the
  base never writes the triple either;
* **scenes**: base images identical (byte for byte) to an RL image, and base scenes whose objects (attributes and
  boxes) equal an RL scene's.

A data measurement (no model); it prints one table and, with ``--out``, writes the figures as JSON.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core.toy.query import parse_query  # noqa: E402
from datamodules import toy  # noqa: E402
from lightning_modules.sft_examples import SFTExamples  # noqa: E402

MIXES = {  # the training mixes of configs/toy_sft_stage_base.yaml and configs/toy_sft_stage_base2.yaml
    "stage1": {"base": 0.6, "base_varied": 0.4},
    "stage2": {"base_solo": 0.25, "base": 0.45, "base_varied": 0.3},
}
CAPTION_FRAC = 0.25


def _image_key(image) -> str:
    return hashlib.sha1(np.asarray(image).tobytes()).hexdigest()


def _scene_key(meta: dict) -> str:
    return json.dumps(sorted((o["size"], o["colour"], o["shape"], o["box"]) for o in meta["objects"]))


def _n_attrs(text: str) -> int:
    d = parse_query(text).desc
    return sum(v is not None for v in (d.size, d.colour, d.shape))


def rl_task(scenes: int) -> tuple[set, set, set]:
    """Query texts, image hashes and scene keys of the first ``scenes`` of each split RL trains and is measured on."""
    rl_queries, rl_images, rl_scenes = set(), set(), set()
    for split in ("train", "val", "ood"):
        for rec in toy.iter_split(split, scenes, seed=0):
            rl_queries.add(rec["meta"]["query"])
            rl_images.add(_image_key(rec["image"]))
            rl_scenes.add(_scene_key(rec["meta"]))
    return rl_queries, rl_images, rl_scenes


def measure(scenes: int, mix: dict[str, float], rl: tuple[set, set, set]) -> dict:
    rl_queries, rl_images, rl_scenes = rl
    examples = SFTExamples(target="toy_base", prompt_template=["toy", "vlm_r1"], caption_frac=CAPTION_FRAC)
    base = toy.ToySceneDataset("train", 1_000_000, seed=0, mix=mix)
    counts = dict.fromkeys(("multi_attribute", "shared_query_text", "target_with_rl_query", "image", "scene"), 0)
    queries, captions = set(), 0
    for i in range(scenes):
        s = base[i]
        caption = examples.is_caption(s)
        captions += caption
        target = f"<answer>{s.query}</answer>" if caption else examples.target_for(s, s.size)
        queries.add(s.query)
        counts["multi_attribute"] += _n_attrs(s.query) >= 2
        counts["target_with_rl_query"] += any(q in target for q in rl_queries if q.split()[1] in target)
        counts["image"] += _image_key(s.image) in rl_images
        counts["scene"] += _scene_key(s.meta) in rl_scenes
    counts["shared_query_text"] = len(queries & rl_queries)
    return {
        "mix": mix,
        "base_samples": scenes,
        "captioning_samples": captions,
        "distinct_base_queries": len(queries),
        "rl_scenes_per_split": scenes,
        "distinct_rl_queries": len(rl_queries),
        "overlap": counts,
    }


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenes", type=int, default=5000)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    t0 = time.time()
    rl = rl_task(args.scenes)
    r: dict = {"stages": {}}
    for stage, mix in MIXES.items():
        m = r["stages"][stage] = measure(args.scenes, mix, rl)
        print(
            f"toy base {stage} mix {mix}: {m['base_samples']} samples ({m['captioning_samples']} captioning, "
            f"{m['distinct_base_queries']} distinct queries) against {m['rl_scenes_per_split']} scenes each of RL's "
            f"train / val / ood ({m['distinct_rl_queries']} distinct queries)"
        )
        for k, v in m["overlap"].items():
            print(f"  overlap {k:<22} {v}")
    if args.out:
        r.update(
            what="toy base SFT mix vs RL's task (bench/toy_base_overlap.py; a data measurement)",
            date=time.strftime("%Y-%m-%d"),
            command="python bench/toy_base_overlap.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            seconds=round(time.time() - t0, 1),
        )
        Path(args.out).write_text(json.dumps(r, indent=1) + "\n")
    return r


if __name__ == "__main__":
    main()
