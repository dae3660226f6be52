"""Region benchmarks of CycleGRPO: ``python -m cli.evaluate gcg | gar-bench ...`` (added to ``cli.evaluate`` through
its ``BENCHMARK_MODULES``).

    python -m cli.evaluate gcg --annotations GranDf/annotations/val_test --image-root GranDf_HA_images/val_test \\
        --split val --policy CKPT --mask-tokenizer TOKENIZER [--text-encoder bert-base-uncased/] --out results/gcg.json
    python -m cli.evaluate gar-bench --data GAR-Bench/annotations/GAR-Bench-VQA.json --policy CKPT \\
        --mask-tokenizer TOKENIZER --out results/gar_vqa.json
    python -m cli.evaluate gcg ... --predictions results/gcg.predictions.jsonl --out results/again.json
    python -m cli.evaluate gcg ... --predictions release_gcg_output_dir/ --out results/release.json
    python -m cli.evaluate gar-bench ... --predictions release_output.json --out results/release.json
    python -m cli.evaluate gar-bench ... --shard 3/8 --out results/gar_3.json     # one GPU's share

GCG (`evals/gcg.py`): each GranD-f image asked the release's question, the caption, phrases
and decoded masks scored as GLaMM does (AP50, mIoU, recall, CIDEr-D; METEOR a named gap). GAR-Bench VQA
(`evals/gar_bench.py`): each question asked with its regions written as mask-token spans by the
mask tokenizer, scored by exact match per category. Both write ``<out stem>.predictions.jsonl``, which
``--predictions`` scores again; ``--predictions`` also reads the released scripts' outputs. A data defect exits 3
with the file and row, a flag mistake 2.
"""

from __future__ import annotations

import argparse
from typing import Any

from cli.evaluate_common import (
    NEEDS_MASK_TOKENIZER,
    add_run_flags,
    check_run_flags,
    load_policy_on_device,
    log_line,
    run_info,
    take_shard,
)
from evals.benchmarks import load_mask_tokenizer
from evals.gar_bench import GAR_MAX_NEW_TOKENS, evaluate_gar, read_gar_predictions, read_gar_vqa
from evals.gcg import GCG_MAX_NEW_TOKENS, BertSimilarity, evaluate_gcg, read_gcg, read_gcg_predictions

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the ``gcg`` and ``gar-bench`` sub-commands to ``cli.evaluate``'s sub-parsers."""
    gcg = sub.add_parser("gcg", help="GCG on GranD-f (AP50, mIoU, recall, CIDEr-D)")
    gcg.add_argument("--annotations", required=True, help="folder of {split}_gcg_coco_{caption,mask}_gt.json")
    gcg.add_argument("--image-root", required=True, help="folder of the GranD-f images (GranDf_HA_images/val_test)")
    gcg.add_argument("--split", default="val", help="val or test")
    gcg.add_argument(
        "--text-encoder", default=None, help="local BERT folder for the recall's phrase similarity (bert-base-uncased)"
    )
    gar = sub.add_parser("gar-bench", help="GAR-Bench VQA (accuracy per category)")
    gar.add_argument("--data", required=True, help="GAR-Bench-VQA.json")
    gar.add_argument("--image-root", default=None, help="folder its 'image' paths start from (default: its folder)")
    for p, handler, unit in ((gcg, _gcg, "image"), (gar, _gar, "question")):
        add_run_flags(p, unit=unit, predictions_help="score these predictions instead of a policy")
        p.set_defaults(handler=handler)


def _gcg(args: argparse.Namespace, command: str) -> int:
    shard = check_run_flags(args, args.benchmark, NEEDS_MASK_TOKENIZER)
    records = take_shard(read_gcg(args.annotations, args.image_root, args.split, max_samples=args.max_samples), shard)
    budget = args.max_new_tokens or GCG_MAX_NEW_TOKENS
    info = run_info(args, command, budget, split=args.split)
    similarity = BertSimilarity(args.text_encoder) if args.text_encoder else None
    tokenizer = load_mask_tokenizer(args.mask_tokenizer, args.sam2, args.device) if args.mask_tokenizer else None
    model = processor = predictions = None
    if args.predictions is not None:
        predictions = read_gcg_predictions(args.predictions)
    else:
        model, processor = load_policy_on_device(args, info)
    res = evaluate_gcg(
        records, args.out, model=model, processor=processor, tokenizer=tokenizer, predictions=predictions,
        similarity=similarity, max_new_tokens=budget, batch_size=args.batch_size, info=info, log=log_line,
    )  # fmt: skip
    m = res["metrics"]
    shown = {k: m[k] for k in ("ap50", "miou", "recall", "recall_iou", "cider")}
    print(f"gcg {args.split}: {res['n']} images, {shown} (METEOR not computed: {res['captions']} is its input)")
    print(f"wrote {args.out} and {res['predictions']}")
    return 0


def _gar(args: argparse.Namespace, command: str) -> int:
    shard = check_run_flags(args, args.benchmark, NEEDS_MASK_TOKENIZER)
    records = take_shard(read_gar_vqa(args.data, args.image_root, max_samples=args.max_samples), shard)
    budget = args.max_new_tokens or GAR_MAX_NEW_TOKENS
    info = run_info(args, command, budget)
    model = processor = predictions = tokenizer = None
    if args.predictions is not None:
        predictions = read_gar_predictions(args.predictions)
    else:
        tokenizer = load_mask_tokenizer(args.mask_tokenizer, args.sam2, args.device)
        model, processor = load_policy_on_device(args, info)
    res = evaluate_gar(
        records, args.out, model=model, processor=processor, tokenizer=tokenizer, predictions=predictions,
        max_new_tokens=budget, batch_size=args.batch_size, info=info, log=log_line,
    )  # fmt: skip
    m = res["metrics"]
    print(f"gar-bench: {res['n']} questions, accuracy {m['accuracy']:.4f}, per type {m['type_accuracy']}")
    print(f"wrote {args.out} and {res['predictions']}")
    return 0
