"""Build the toy VQ mask tokenizer and measure its round trip (docs/mask_tokens.md).

    OMP_NUM_THREADS=1 python -m cli.mask_tokenizer --out checkpoints/toy-mask-tokenizer

Trains on exact toy-world masks (one CPU thread by default, deterministic for a fixed seed), then encodes and decodes
``--eval-masks`` held-out masks and reports their pixel IoU with the exact masks: the ceiling of a mask reward. Writes
``config.json`` (architecture, metrics, the command) and ``model.safetensors`` into ``--out``.
``--measure PATH`` only re-measures a built tokenizer. ``--add-to-policy SRC --out DST`` writes a copy of the policy
checkpoint SRC with the 514 mask tokens in its tokenizer and embeddings (for engines that load a folder, e.g. vLLM).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time

import torch

from cli.mask_tokenizer_training import (
    EVAL_SPLITS,
    ToyTrainArgs,
    build_mask_set,
    evaluate,
    train_toy,
)
from lightning_modules.models.loading import load_policy
from lightning_modules.models.mask_tokenizer.toy import ToyMaskTokenizer
from lightning_modules.models.mask_tokenizer.vocab import add_mask_tokens


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m cli.mask_tokenizer", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="checkpoints/toy-mask-tokenizer", help="output folder")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: ToyTrainArgs.steps)")
    parser.add_argument("--train-scenes", type=int, default=None, help="toy scenes to take masks from")
    parser.add_argument("--eval-masks", type=int, default=512, help="held-out masks the round trip is measured on")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=1, help="torch CPU threads (results depend on it)")
    parser.add_argument("--measure", default=None, metavar="PATH", help="only measure the tokenizer at PATH")
    parser.add_argument(
        "--add-to-policy", default=None, metavar="SRC", help="write policy SRC with the mask tokens added to --out"
    )
    args = parser.parse_args(argv)
    if args.add_to_policy:
        model, processor = load_policy(args.add_to_policy, dtype="fp32")
        ids = add_mask_tokens(model, processor)
        model.save_pretrained(args.out)
        processor.save_pretrained(args.out)
        print(f"wrote {args.out}: {args.add_to_policy} with mask tokens at ids {ids[0]}..{ids[-1]}")
        return 0

    torch.set_num_threads(args.threads)
    if args.measure:
        tok = ToyMaskTokenizer.load(args.measure)
        held_out = build_mask_set(EVAL_SPLITS, max(1, args.eval_masks // 2), args.seed)
        print(json.dumps(evaluate(tok, held_out, args.eval_masks, seed=args.seed), indent=2))
        return 0
    train_args = ToyTrainArgs(seed=args.seed, eval_masks=args.eval_masks)
    if args.steps is not None:
        train_args.steps = args.steps
        train_args.warmup = min(train_args.warmup, args.steps // 4)
    if args.train_scenes is not None:
        train_args.train_scenes = args.train_scenes
    t0 = time.perf_counter()
    tok, metrics = train_toy(train_args, log=lambda line: print(line, flush=True))
    extra = {
        "metrics": metrics,
        "built_by": "python -m cli.mask_tokenizer " + " ".join(sys.argv[1:] if argv is None else argv),
        "built_on": f"{platform.machine()} {platform.processor() or platform.system()}, {args.threads} thread(s)",
        "build_seconds": round(time.perf_counter() - t0, 1),
        "parameters": tok.n_parameters(),
    }
    out = tok.save(args.out, extra)
    print(json.dumps(extra, indent=2))
    print(f"wrote {out}/config.json and {out}/model.safetensors")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
