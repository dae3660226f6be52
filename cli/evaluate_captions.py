"""Judged captioning benchmarks of CycleGRPO: ``python -m cli.evaluate dlc-bench ...`` (added to ``cli.evaluate``
through its ``BENCHMARK_MODULES``).

    vllm serve meta-llama/Llama-3.1-8B-Instruct --served-model-name judge --port 8000   # the release's judge
    python -m cli.evaluate dlc-bench --data DLC-Bench/annotations --policy CKPT --mask-tokenizer TOKENIZER \\
        --judge-url http://127.0.0.1:8000/v1 --out results/dlc.json
    python -m cli.evaluate dlc-bench --data DLC-Bench/annotations --predictions results/dlc.predictions.jsonl \\
        --judge-url http://127.0.0.1:8000/v1 --out results/dlc_again.json     # re-judge saved captions
    python -m cli.evaluate dlc-bench ... --predictions model_outputs/release_cache.json ...   # the release's captions

DLC-Bench (`evals/dlc_bench.py`): the policy captions each region (its mask written as a
mask-token span by the mask tokenizer), a text-only judge answers the benchmark's questions from the caption, and the
scores are the benchmark's (positive, negative, their average). Writes ``<out stem>.predictions.jsonl`` (captions and
the judge's answers), which ``--predictions`` judges again. A data defect exits 3 with the file and key, a flag
mistake 2, an unreachable judge under ``--judge-on-failure raise`` 4.
"""

from __future__ import annotations

import argparse
from typing import Any

from cli.errors import fail
from cli.evaluate_common import (
    NEEDS_MASK_TOKENIZER,
    add_judge_flags,
    add_run_flags,
    check_run_flags,
    load_policy_on_device,
    log_line,
    open_judge,
    run_info,
    take_shard,
    with_judge,
)
from evals.benchmarks import load_mask_tokenizer
from evals.dlc_bench import DLC_MAX_NEW_TOKENS, evaluate_dlc, read_dlc_bench, read_dlc_predictions

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the ``dlc-bench`` sub-command to ``cli.evaluate``'s sub-parsers."""
    p = sub.add_parser("dlc-bench", help="DLC-Bench: region captions judged by a text-only LLM (pos, neg, avg)")
    p.add_argument("--data", required=True, help="DLC-Bench's annotations folder (annotations.json, qa.json, ...)")
    p.add_argument("--image-root", default=None, help="folder of the images (default: <data>/images)")
    add_run_flags(
        p,
        unit="region",
        predictions_help="judge these captions instead of running a policy",
        max_new_tokens=(None, "caption budget (default: the release's 1024)"),
    )
    add_judge_flags(
        p,
        url_help="OpenAI-compatible base URL of the judge (…/v1); required",
        failure_help="value: a failed judge call reads as no choice (score 0); raise: stop with one line",
        tunable=True,
    )
    p.set_defaults(handler=_dlc)


def _dlc(args: argparse.Namespace, command: str) -> int:
    shard = check_run_flags(args, "dlc-bench", NEEDS_MASK_TOKENIZER)
    if args.judge_url is None:
        fail("cli.evaluate dlc-bench needs --judge-url: a text-only LLM judge answers the benchmark's questions "
             "(python -m cli.judge_server for a toy one, vllm serve for a real one)")  # fmt: skip
    if args.judge_concurrency < 1 or args.judge_max_tokens < 1 or not args.judge_timeout > 0:
        fail("--judge-concurrency and --judge-max-tokens must be >= 1 and --judge-timeout > 0")
    records = take_shard(read_dlc_bench(args.data, args.image_root, max_samples=args.max_samples), shard)
    budget = args.max_new_tokens or DLC_MAX_NEW_TOKENS
    info = {**run_info(args, command, budget), "judge_url": args.judge_url, "judge_model": args.judge_model}
    model = processor = predictions = tokenizer = None
    if args.predictions is not None:
        predictions = read_dlc_predictions(args.predictions)
    else:
        tokenizer = load_mask_tokenizer(args.mask_tokenizer, args.sam2, args.device)
        model, processor = load_policy_on_device(args, info)
    judge = open_judge(args, max_tokens=args.judge_max_tokens, max_concurrency=args.judge_concurrency)
    res = with_judge(
        judge,
        lambda judge: evaluate_dlc(
            records, args.out, judge, model=model, processor=processor, tokenizer=tokenizer, predictions=predictions,
            max_new_tokens=budget, batch_size=args.batch_size, info=info, log=log_line,
        ),
    )  # fmt: skip
    m = res["metrics"]
    shown = ", ".join(f"{k} {m[k]:.3f}" if m[k] is not None else f"{k} -" for k in ("pos", "neg", "avg"))
    print(f"dlc-bench: {res['n']} regions, {shown} (judge failures {m['judge_failures']})")
    print(f"wrote {args.out} and {res['predictions']}")
    return 0
