"""Judged captioning benchmarks of CycleGRPO: ``python -m cli.evaluate dlc-bench ...`` (added to ``cli.evaluate``
through its ``BENCHMARK_MODULES``).

    vllm serve meta-llama/Llama-3.1-8B-Instruct --served-model-name judge --port 8000   # the release's judge
    python -m cli.evaluate dlc-bench --data DLC-Bench/annotations --policy CKPT --mask-tokenizer TOKENIZER \\
        --judge-url http://127.0.0.1:8000/v1 --out results/dlc.json
    python -m cli.evaluate dlc-bench --data DLC-Bench/annotations --predictions results/dlc.predictions.jsonl \\
        --judge-url http://127.0.0.1:8000/v1 --out results/dlc_again.json     # re-judge saved captions
    python -m cli.evaluate dlc-bench ... --predictions model_outputs/release_cache.json ...   # the release's captions

DLC-Bench (`lightning_modules/evaluation/dlc_bench.py`): the policy captions each region (its mask written as a
mask-token span by the mask tokenizer), a text-only judge answers the benchmark's questions from the caption, and the
scores are the benchmark's (positive, negative, their average). Writes ``<out stem>.predictions.jsonl`` (captions and
the judge's answers), which ``--predictions`` judges again. A data defect exits 3 with the file and key, a flag
mistake 2, an unreachable judge under ``--judge-on-failure raise`` 4.
"""

from __future__ import annotations

import argparse
from typing import Any

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the ``dlc-bench`` sub-command to ``cli.evaluate``'s sub-parsers."""
    p = sub.add_parser("dlc-bench", help="DLC-Bench: region captions judged by a text-only LLM (pos, neg, avg)")
    p.add_argument("--data", required=True, help="DLC-Bench's annotations folder (annotations.json, qa.json, ...)")
    p.add_argument("--image-root", default=None, help="folder of the images (default: <data>/images)")
    p.add_argument("--out", required=True, help="results JSON; predictions go to <stem>.predictions.jsonl beside it")
    p.add_argument("--policy", default=None, help="policy checkpoint folder (save_pretrained layout)")
    p.add_argument("--mask-tokenizer", default=None, help="toy tokenizer folder, or the release's .pth with --sam2")
    p.add_argument("--sam2", default=None, help="SAM 2 weights (.pt or a transformers folder) for a VQ-SAM2 .pth")
    p.add_argument("--predictions", nargs="+", default=None, help="judge these captions instead of running a policy")
    p.add_argument("--shard", default=None, metavar="I/N", help="only every N-th region from the I-th (0-based)")
    p.add_argument("--max-new-tokens", type=int, default=None, help="caption budget (default: the release's 1024)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--max-samples", type=int, default=None, help="only the first N regions")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")
    p.add_argument("--judge-url", default=None, help="OpenAI-compatible base URL of the judge (…/v1); required")
    p.add_argument("--judge-model", default="judge", help="model name sent to the judge server")
    p.add_argument("--judge-timeout", type=float, default=60.0, help="seconds per judge request attempt")
    p.add_argument("--judge-concurrency", type=int, default=8, help="judge requests in flight at once")
    p.add_argument("--judge-max-tokens", type=int, default=300, help="reply budget per question (the release: 300)")
    p.add_argument(
        "--judge-on-failure",
        choices=("value", "raise"),
        default="value",
        help="value: a failed judge call reads as no choice (score 0); raise: stop with one line",
    )
    p.set_defaults(handler=_dlc)


def _dlc(args: argparse.Namespace, command: str) -> int:
    from cli.errors import fail
    from cli.evaluate_regions import _check, _info, _log, _policy
    from lightning_modules.evaluation.benchmarks import load_mask_tokenizer
    from lightning_modules.evaluation.dlc_bench import (
        DLC_MAX_NEW_TOKENS,
        evaluate_dlc,
        read_dlc_bench,
        read_dlc_predictions,
    )
    from lightning_modules.judge import JudgeClient, JudgeConfig, JudgeUnavailable

    shard = _check(args)
    if args.judge_url is None:
        fail("cli.evaluate dlc-bench needs --judge-url: a text-only LLM judge answers the benchmark's questions "
             "(python -m cli.judge_server for a toy one, vllm serve for a real one)")  # fmt: skip
    if args.judge_concurrency < 1 or args.judge_max_tokens < 1 or not args.judge_timeout > 0:
        fail("--judge-concurrency and --judge-max-tokens must be >= 1 and --judge-timeout > 0")
    records = read_dlc_bench(args.data, args.image_root, max_samples=args.max_samples)
    if shard is not None:
        records = records[shard[0] :: shard[1]]
    budget = args.max_new_tokens or DLC_MAX_NEW_TOKENS
    info = {**_info(args, command, budget), "judge_url": args.judge_url, "judge_model": args.judge_model}
    model = processor = predictions = tokenizer = None
    if args.predictions is not None:
        predictions = read_dlc_predictions(args.predictions)
    else:
        tokenizer = load_mask_tokenizer(args.mask_tokenizer, args.sam2)
        model, processor = _policy(args, info)
    judge = JudgeClient(
        JudgeConfig(
            base_url=args.judge_url,
            model=args.judge_model,
            timeout_s=args.judge_timeout,
            max_concurrency=args.judge_concurrency,
            max_tokens=args.judge_max_tokens,
            on_failure=args.judge_on_failure,
        )  # fmt: skip
    )
    try:
        res = evaluate_dlc(
            records, args.out, judge, model=model, processor=processor, tokenizer=tokenizer, predictions=predictions,
            max_new_tokens=budget, batch_size=args.batch_size, info=info, log=_log,
        )  # fmt: skip
    except JudgeUnavailable as err:
        fail(str(err).replace("set judge.on_failure: value", "pass --judge-on-failure value"), 4)
    finally:
        judge.close()
    m = res["metrics"]
    shown = ", ".join(f"{k} {m[k]:.3f}" if m[k] is not None else f"{k} -" for k in ("pos", "neg", "avg"))
    print(f"dlc-bench: {res['n']} regions, {shown} (judge failures {m['judge_failures']})")
    print(f"wrote {args.out} and {res['predictions']}")
    return 0
