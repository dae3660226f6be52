"""The benchmarks of CycleGRPO and Generalized CycleGRPO, one sub-command each: ``python -m cli.evaluate BENCHMARK``.

    python -m cli.evaluate gres --grefs grefs(unc).json --instances instances.json --image-root coco/train2014 \\
        --split val --policy CKPT --mask-tokenizer TOKENIZER --out results/gres_val.json
    python -m cli.evaluate groundingsuite --data GroundingSuite-Eval.jsonl --policy CKPT --mask-tokenizer TOKENIZER \\
        --out results/groundingsuite.json
    python -m cli.evaluate gcg --annotations GranDf/annotations/val_test --image-root GranDf_HA_images/val_test \\
        --split val --policy CKPT --mask-tokenizer TOKENIZER --out results/gcg.json
    python -m cli.evaluate gar-bench --data GAR-Bench-VQA.json --policy CKPT --mask-tokenizer TOKENIZER \\
        --out results/gar_vqa.json
    python -m cli.evaluate dlc-bench --data DLC-Bench/annotations --policy CKPT --mask-tokenizer TOKENIZER \\
        --judge-url http://127.0.0.1:8000/v1 --out results/dlc.json
    python -m cli.evaluate vstar --data V_STaR_test.json --video-root videos --policy CKPT --out results/vstar.json
    python -m cli.evaluate dove --data dove.jsonl --video-root videos --policy CKPT --judge-url URL --out dove.json
    python -m cli.evaluate BENCHMARK ... --shard 3/8 --out results/x_3.json                      # one GPU's share
    python -m cli.evaluate BENCHMARK ... --predictions results/x_*.predictions.jsonl --out results/x.json   # score them

Every sub-command runs a policy checkpoint (``--policy``) or scores predictions made before (``--predictions``: its
own ``<out stem>.predictions.jsonl`` files, or the released scripts' outputs where a benchmark reads them), writes the
results to ``--out`` and every item's prediction to ``<out stem>.predictions.jsonl``; ``--shard I/N`` runs one GPU's
share, whose predictions files ``--predictions`` merges. ``python -m cli.evaluate BENCHMARK --help`` lists a
benchmark's flags; the shared ones, their checks and the policy loading are ``cli/evaluate_common.py``'s. Here: gres
and groundingsuite; ``BENCHMARK_MODULES`` add the others (``cli/evaluate_regions.py``: gcg, gar-bench;
``cli/evaluate_captions.py``: dlc-bench; ``cli/evaluate_video.py``: vstar, dove).

GRES / GroundingSuite read the benchmark (``datamodules/gres.py``), answer each expression greedily with the policy
under the released question (``--template``), decode the answer's mask tokens with the mask tokenizer and score the
masks (``evals/benchmarks.py``: GRES gIoU / cIoU / N-acc / T-acc; GroundingSuite gIoU per
class). A data defect exits 3 with the file and row; a flag mistake or a missing file exits 2; an unreachable judge
under ``--judge-on-failure raise`` exits 4.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from cli.errors import fail
from cli.evaluate_common import (
    add_run_flags,
    check_run_flags,
    load_policy_on_device,
    log_line,
    run_info,
    take_shard,
)
from core.prompts import PROMPT_TEMPLATES
from core.records import DataError
from datamodules.gres import read_gres, read_groundingsuite
from evals.benchmarks import evaluate_benchmark, load_mask_tokenizer, read_predictions

BENCHMARK_MODULES: tuple[str, ...] = ("cli.evaluate_video", "cli.evaluate_regions", "cli.evaluate_captions")
"""Modules that add more benchmarks: each has ``register(subparsers)``, which adds its sub-commands with
``set_defaults(handler=fn)``; ``fn(args, command) -> int`` runs one (a ``DataError`` exits 3, a missing file 2)."""

DEFAULTS = {"gres": ("gres", 128), "groundingsuite": ("groundingsuite", 512)}
"""Per benchmark: the prompt template and the answer budget of the released evaluation scripts."""


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m cli.evaluate",
        description="\n\n".join(__doc__.split("\n\n")[:2]),  # what it is, and one example per benchmark
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
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
        add_run_flags(p, unit="expression", predictions_help="score these predictions JSONL files instead of a policy")
        p.add_argument("--template", default=None, help="prompt template (default: the benchmark's released question)")
        p.set_defaults(handler=_masks)
    for name in BENCHMARK_MODULES:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
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
    shard = check_run_flags(args, args.benchmark, ("--mask-tokenizer", "to decode the answers' mask tokens"))
    template, budget = DEFAULTS[args.benchmark]
    template = args.template or template

    if template not in PROMPT_TEMPLATES:
        fail(f"--template {template!r} is not a prompt template; one of {sorted(PROMPT_TEMPLATES)}")
    return _run(args, template, args.max_new_tokens or budget, command, shard)


def _run(
    args: argparse.Namespace, template: str, max_new_tokens: int, command: str, shard: tuple[int, int] | None
) -> int:
    if args.benchmark == "gres":
        records = read_gres(args.grefs, args.instances, args.image_root, args.split, max_samples=args.max_samples)
    else:
        records = read_groundingsuite(args.data, args.image_root, max_samples=args.max_samples)
    records = take_shard(records, shard)
    tokenizer = load_mask_tokenizer(args.mask_tokenizer, args.sam2, args.device) if args.mask_tokenizer else None
    info = run_info(args, command, max_new_tokens, split=getattr(args, "split", None), template=template)
    model = processor = predictions = None
    if args.predictions is not None:
        predictions = read_predictions(args.predictions)
    else:
        model, processor = load_policy_on_device(args, info)
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
        log=log_line,
    )
    metrics = {k: v for k, v in results["metrics"].items() if not isinstance(v, dict)}
    print(f"{args.benchmark}: {results['n']} samples, {metrics}, answers {results['answers']}")
    print(f"wrote {args.out} and {results['predictions']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
