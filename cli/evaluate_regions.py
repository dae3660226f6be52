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

GCG (`lightning_modules/evaluation/gcg.py`): each GranD-f image asked the release's question, the caption, phrases
and decoded masks scored as GLaMM does (AP50, mIoU, recall, CIDEr-D; METEOR a named gap). GAR-Bench VQA
(`lightning_modules/evaluation/gar_bench.py`): each question asked with its regions written as mask-token spans by the
mask tokenizer, scored by exact match per category. Both write ``<out stem>.predictions.jsonl``, which
``--predictions`` scores again; ``--predictions`` also reads the released scripts' outputs. A data defect exits 3
with the file and row, a flag mistake 2.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

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
    for p, handler in ((gcg, _gcg), (gar, _gar)):
        p.add_argument(
            "--out", required=True, help="results JSON; predictions go to <stem>.predictions.jsonl beside it"
        )
        p.add_argument("--policy", default=None, help="policy checkpoint folder (save_pretrained layout)")
        p.add_argument("--mask-tokenizer", default=None, help="toy tokenizer folder, or the release's .pth with --sam2")
        p.add_argument("--sam2", default=None, help="SAM 2 weights (.pt or a transformers folder) for a VQ-SAM2 .pth")
        p.add_argument("--predictions", nargs="+", default=None, help="score these predictions instead of a policy")
        p.add_argument("--shard", default=None, metavar="I/N", help="only every N-th item from the I-th (0-based)")
        p.add_argument("--max-new-tokens", type=int, default=None, help="answer budget (default: the release's)")
        p.add_argument("--batch-size", type=int, default=8)
        p.add_argument("--max-samples", type=int, default=None, help="only the first N items")
        p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32")
        p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
        p.set_defaults(handler=handler)


def _check(args: argparse.Namespace) -> tuple[int, int] | None:
    """The flags every region benchmark shares; returns the shard."""
    from cli.errors import fail
    from cli.evaluate import _shard

    if (args.policy is None) == (args.predictions is None):
        fail(f"cli.evaluate {args.benchmark}: give --policy (run the policy) or --predictions (score a file), one")
    if args.policy is not None and args.mask_tokenizer is None:
        fail(f"cli.evaluate {args.benchmark} --policy needs --mask-tokenizer for the mask tokens")
    if args.batch_size < 1:
        fail(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        fail(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return _shard(args.shard) if args.shard else None


def _policy(args: argparse.Namespace, info: dict[str, Any]) -> tuple[Any, Any]:
    """The policy and its processor on ``--device``, able to write mask tokens."""
    import torch

    from lightning_modules.models.loading import load_policy
    from lightning_modules.models.mask_tokenizer.vocab import add_mask_tokens

    model, processor = load_policy(args.policy, dtype=args.dtype)
    add_mask_tokens(model, processor)  # a no-op for a policy that has them
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    info["device"] = device
    return model, processor


def _info(args: argparse.Namespace, command: str, max_new_tokens: int) -> dict[str, Any]:
    return {
        "policy": args.policy,
        "mask_tokenizer": args.mask_tokenizer,
        "max_new_tokens": max_new_tokens,
        "shard": args.shard,
        "scored_files": args.predictions,
        "command": command,
    }


def _log(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _gcg(args: argparse.Namespace, command: str) -> int:
    from lightning_modules.evaluation.benchmarks import load_mask_tokenizer
    from lightning_modules.evaluation.gcg import (
        GCG_MAX_NEW_TOKENS,
        BertSimilarity,
        evaluate_gcg,
        read_gcg,
        read_gcg_predictions,
    )

    shard = _check(args)
    records = read_gcg(args.annotations, args.image_root, args.split, max_samples=args.max_samples)
    if shard is not None:
        records = records[shard[0] :: shard[1]]
    budget = args.max_new_tokens or GCG_MAX_NEW_TOKENS
    info = {"split": args.split, **_info(args, command, budget)}
    similarity = BertSimilarity(args.text_encoder) if args.text_encoder else None
    tokenizer = load_mask_tokenizer(args.mask_tokenizer, args.sam2) if args.mask_tokenizer else None
    model = processor = predictions = None
    if args.predictions is not None:
        predictions = read_gcg_predictions(args.predictions)
    else:
        model, processor = _policy(args, info)
    res = evaluate_gcg(
        records, args.out, model=model, processor=processor, tokenizer=tokenizer, predictions=predictions,
        similarity=similarity, max_new_tokens=budget, batch_size=args.batch_size, info=info, log=_log,
    )  # fmt: skip
    m = res["metrics"]
    shown = {k: m[k] for k in ("ap50", "miou", "recall", "recall_iou", "cider")}
    print(f"gcg {args.split}: {res['n']} images, {shown} (METEOR not computed: {res['captions']} is its input)")
    print(f"wrote {args.out} and {res['predictions']}")
    return 0


def _gar(args: argparse.Namespace, command: str) -> int:
    from lightning_modules.evaluation.benchmarks import load_mask_tokenizer
    from lightning_modules.evaluation.gar_bench import (
        GAR_MAX_NEW_TOKENS,
        evaluate_gar,
        read_gar_predictions,
        read_gar_vqa,
    )

    shard = _check(args)
    records = read_gar_vqa(args.data, args.image_root, max_samples=args.max_samples)
    if shard is not None:
        records = records[shard[0] :: shard[1]]
    budget = args.max_new_tokens or GAR_MAX_NEW_TOKENS
    info = _info(args, command, budget)
    model = processor = predictions = tokenizer = None
    if args.predictions is not None:
        predictions = read_gar_predictions(args.predictions)
    else:
        tokenizer = load_mask_tokenizer(args.mask_tokenizer, args.sam2)
        model, processor = _policy(args, info)
    res = evaluate_gar(
        records, args.out, model=model, processor=processor, tokenizer=tokenizer, predictions=predictions,
        max_new_tokens=budget, batch_size=args.batch_size, info=info, log=_log,
    )  # fmt: skip
    m = res["metrics"]
    print(f"gar-bench: {res['n']} questions, accuracy {m['accuracy']:.4f}, per type {m['type_accuracy']}")
    print(f"wrote {args.out} and {res['predictions']}")
    return 0
