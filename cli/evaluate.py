"""Referring-segmentation benchmarks of CycleGRPO: ``python -m cli.evaluate gres | groundingsuite ...``.

    python -m cli.evaluate gres --grefs DIR/grefs(unc).json --instances DIR/instances.json \\
        --image-root coco/train2014 --split val --policy CKPT --mask-tokenizer TOKENIZER --out results/gres_val.json
    python -m cli.evaluate groundingsuite --data GroundingSuite-Eval.jsonl --policy CKPT --mask-tokenizer TOKENIZER \\
        --out results/groundingsuite.json
    python -m cli.evaluate gres ... --predictions preds.jsonl --out results/gres_val.json     # score made predictions
    python -m cli.evaluate gres ... --shard 3/8 --out results/gres_val_3.json                 # one GPU's share
    python -m cli.evaluate gres ... --predictions results/gres_val_*.predictions.jsonl --out results/gres_val.json

Reads the benchmark (``datamodules/gres.py``), answers each expression greedily with the policy under the released
question (``--template``), decodes the answer's mask tokens with the mask tokenizer and scores the masks
(``lightning_modules/evaluation/benchmarks.py``: GRES gIoU / cIoU / N-acc / T-acc; GroundingSuite gIoU per class).
Writes the results to ``--out`` and every sample's prediction to ``<out stem>.predictions.jsonl``, which
``--predictions`` scores again. A data defect exits 3 with the file and row; a flag mistake exits 2.
"""

from __future__ import annotations

import argparse
import importlib
import sys

BENCHMARK_MODULES: tuple[str, ...] = ("cli.evaluate_video", "cli.evaluate_regions", "cli.evaluate_captions")
"""Modules that add more benchmarks: each has ``register(subparsers)``, which adds its sub-commands with
``set_defaults(handler=fn)``; ``fn(args, command) -> int`` runs one (a ``DataError`` exits 3, a missing file 2)."""

DEFAULTS = {"gres": ("gres", 128), "groundingsuite": ("groundingsuite", 512)}
"""Per benchmark: the prompt template and the answer budget of the released evaluation scripts."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m cli.evaluate", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="benchmark", required=True)
    gres = sub.add_parser("gres", help="GRES / gRefCOCO (val, testA, testB)")
    gres.add_argument("--grefs", required=True, help="gRefCOCO refs: grefs(unc).json")
    gres.add_argument("--instances", required=True, help="COCO instances of the refs' images: instances.json")
    gres.add_argument("--image-root", required=True, help="folder of the COCO images (train2014)")
    gres.add_argument("--split", default="val", help="val, testA or testB")
    gs = sub.add_parser("groundingsuite", help="GroundingSuite-Eval (gIoU per class)")
    gs.add_argument("--data", required=True, help="GroundingSuite-Eval.jsonl")
    gs.add_argument("--image-root", default=None, help="folder its image_path values start from (default: its folder)")
    for p in (gres, gs):
        p.add_argument(
            "--out", required=True, help="results JSON; predictions go to <stem>.predictions.jsonl beside it"
        )
        p.add_argument("--policy", default=None, help="policy checkpoint folder (save_pretrained layout)")
        p.add_argument("--mask-tokenizer", default=None, help="toy tokenizer folder, or the release's .pth with --sam2")
        p.add_argument("--sam2", default=None, help="SAM 2 weights (.pt or a transformers folder) for a VQ-SAM2 .pth")
        p.add_argument(
            "--predictions", nargs="+", default=None, help="score these predictions JSONL files instead of a policy"
        )
        p.add_argument(
            "--shard", default=None, metavar="I/N", help="only every N-th expression from the I-th (0-based)"
        )
        p.add_argument("--template", default=None, help="prompt template (default: the benchmark's released question)")
        p.add_argument("--max-new-tokens", type=int, default=None, help="answer budget (default: the release's)")
        p.add_argument("--batch-size", type=int, default=8)
        p.add_argument("--max-samples", type=int, default=None, help="only the first N expressions")
        p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32")
        p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
        p.set_defaults(handler=_masks)
    for name in BENCHMARK_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from cli.errors import fail
    from core.records import DataError

    args = _parser().parse_args(argv)
    command = "python -m cli.evaluate " + " ".join(sys.argv[1:] if argv is None else argv)
    try:
        return args.handler(args, command)
    except DataError as err:
        fail(str(err), 3)
    except FileNotFoundError as err:
        fail(str(err), 2)


def _masks(args: argparse.Namespace, command: str) -> int:
    """GRES / GroundingSuite: the policy's mask tokens decoded and scored."""
    from cli.errors import fail

    if (args.policy is None) == (args.predictions is None):
        fail(f"cli.evaluate {args.benchmark}: give --policy (run the policy) or --predictions (score a file), one")
    if args.policy is not None and args.mask_tokenizer is None:
        fail(f"cli.evaluate {args.benchmark} --policy needs --mask-tokenizer to decode the answers' mask tokens")
    if args.batch_size < 1:
        fail(f"--batch-size must be >= 1, got {args.batch_size}")
    shard = _shard(args.shard) if args.shard else None
    template, budget = DEFAULTS[args.benchmark]
    template = args.template or template
    from lightning_modules.models.prompts import PROMPT_TEMPLATES

    if template not in PROMPT_TEMPLATES:
        fail(f"--template {template!r} is not a prompt template; one of {sorted(PROMPT_TEMPLATES)}")
    return _run(args, template, args.max_new_tokens or budget, command, shard)


def _shard(text: str) -> tuple[int, int]:
    from cli.errors import fail

    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        fail(f"--shard takes I/N (e.g. 3/8: the 4th of 8 shares), got {text!r}")
    if not 0 <= i < n:
        fail(f"--shard {text}: need 0 <= I < N")
    return i, n


def _run(
    args: argparse.Namespace, template: str, max_new_tokens: int, command: str, shard: tuple[int, int] | None
) -> int:
    from datamodules.gres import read_gres, read_groundingsuite
    from lightning_modules.evaluation.benchmarks import evaluate_benchmark, load_mask_tokenizer, read_predictions

    if args.benchmark == "gres":
        records = read_gres(args.grefs, args.instances, args.image_root, args.split, max_samples=args.max_samples)
    else:
        records = read_groundingsuite(args.data, args.image_root, max_samples=args.max_samples)
    if shard is not None:
        records = records[shard[0] :: shard[1]]
    tokenizer = load_mask_tokenizer(args.mask_tokenizer, args.sam2) if args.mask_tokenizer else None
    info = {
        "split": getattr(args, "split", None),
        "policy": args.policy,
        "mask_tokenizer": args.mask_tokenizer,
        "template": template,
        "max_new_tokens": max_new_tokens,
        "shard": args.shard,
        "command": command,
    }
    model = processor = predictions = None
    if args.predictions is not None:
        predictions = read_predictions(args.predictions)
        info["scored_files"] = args.predictions
    else:
        import torch

        from lightning_modules.models.loading import load_policy
        from lightning_modules.models.mask_tokenizer.vocab import add_mask_tokens

        model, processor = load_policy(args.policy, dtype=args.dtype)
        add_mask_tokens(model, processor)  # a no-op for a policy that has them; a fresh one can then write them
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        model.to(device).eval()
        info["device"] = device
    results = evaluate_benchmark(
        args.benchmark,
        records,
        args.out,
        model=model,
        processor=processor,
        tokenizer=tokenizer,
        predictions=predictions,
        template=template,
        max_new_tokens=max_new_tokens,
        batch_size=args.batch_size,
        info=info,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    metrics = {k: v for k, v in results["metrics"].items() if not isinstance(v, dict)}
    print(f"{args.benchmark}: {results['n']} samples, {metrics}, answers {results['answers']}")
    print(f"wrote {args.out} and {results['predictions']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
