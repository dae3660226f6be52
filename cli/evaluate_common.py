"""What every ``python -m cli.evaluate`` sub-command shares: its flags, their checks, the policy, the judge.

Each benchmark (``cli/evaluate.py``: gres, groundingsuite; ``cli/evaluate_regions.py``: gcg, gar-bench;
``cli/evaluate_captions.py``: dlc-bench; ``cli/evaluate_video.py``: vstar, dove) either runs a policy checkpoint
(``--policy``) or scores predictions made before (``--predictions``), on all of its items or one GPU's share
(``--shard I/N``), and writes the results JSON to ``--out`` with a ``<out stem>.predictions.jsonl`` beside it. The
flags for that, their one-line errors (exit 2), loading the policy on its device, the run's ``info`` block of the
results, the progress line on stderr and the judge client (an unreachable judge under ``--judge-on-failure raise``
exits 4) live here once, so the benchmarks differ only in what is theirs: their data flags and their scorer.

Heavy imports (torch, the policy, the judge client) happen inside the functions that need them, so building the
parser for ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

from cli.errors import fail
from lightning_modules.judge import JudgeClient, JudgeConfig, JudgeUnavailable
from lightning_modules.models.loading import load_policy
from lightning_modules.models.mask_tokenizer.vocab import add_mask_tokens

__all__ = [
    "NEEDS_MASK_TOKENIZER",
    "add_judge_flags",
    "add_run_flags",
    "check_run_flags",
    "log_line",
    "load_policy_on_device",
    "open_judge",
    "parse_shard",
    "run_info",
    "take_shard",
    "with_judge",
]

T = TypeVar("T")

ANSWER_BUDGET = (None, "answer budget (default: the release's)")
"""``--max-new-tokens`` of a benchmark whose budget is the released script's (``None``: the handler picks it)."""

NEEDS_MASK_TOKENIZER = ("--mask-tokenizer", "for the mask tokens")
"""``check_run_flags``'s ``policy_needs`` for a benchmark whose regions or answers are mask tokens."""


def add_run_flags(
    p: argparse.ArgumentParser,
    *,
    unit: str,
    mask_tokenizer: bool = True,
    predictions_help: str = "score these predictions files instead of a policy",
    max_new_tokens: tuple[int | None, str] = ANSWER_BUDGET,
    batch_size: tuple[int, str | None] = (8, None),
) -> None:
    """Add the flags every benchmark shares to its sub-parser ``p``.

    ``unit`` names what ``--shard`` and ``--max-samples`` count (expression, item, region); ``mask_tokenizer`` adds
    ``--mask-tokenizer`` and ``--sam2`` for a benchmark whose answers or questions hold mask tokens;
    ``max_new_tokens`` and ``batch_size`` are each flag's (default, help).
    """
    p.add_argument("--out", required=True, help="results JSON; predictions go to <stem>.predictions.jsonl beside it")
    p.add_argument("--policy", default=None, help="policy checkpoint folder (save_pretrained layout)")
    if mask_tokenizer:
        p.add_argument("--mask-tokenizer", default=None, help="toy tokenizer folder, or the release's .pth with --sam2")
        p.add_argument("--sam2", default=None, help="SAM 2 weights (.pt or a transformers folder) for a VQ-SAM2 .pth")
    p.add_argument("--predictions", nargs="+", default=None, help=predictions_help)
    p.add_argument("--shard", default=None, metavar="I/N", help=f"only every N-th {unit} from the I-th (0-based)")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens[0], help=max_new_tokens[1])
    p.add_argument("--batch-size", type=int, default=batch_size[0], help=batch_size[1])
    p.add_argument("--max-samples", type=int, default=None, help=f"only the first N {unit}s")
    p.add_argument("--dtype", default="auto", help="auto (bf16 on CUDA, fp32 on CPU), bf16, fp16, fp32")
    p.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda when available)")


def add_judge_flags(p: argparse.ArgumentParser, *, url_help: str, failure_help: str, tunable: bool = False) -> None:
    """Add the judge server's flags; ``tunable`` adds ``--judge-concurrency`` and ``--judge-max-tokens`` too."""
    p.add_argument("--judge-url", default=None, help=url_help)
    p.add_argument("--judge-model", default="judge", help="model name sent to the judge server")
    p.add_argument("--judge-timeout", type=float, default=60.0, help="seconds per judge request attempt")
    if tunable:
        p.add_argument("--judge-concurrency", type=int, default=8, help="judge requests in flight at once")
        p.add_argument("--judge-max-tokens", type=int, default=300, help="reply budget per question (the release: 300)")
    p.add_argument("--judge-on-failure", choices=("value", "raise"), default="value", help=failure_help)


def parse_shard(text: str) -> tuple[int, int]:
    """``--shard I/N`` as ``(I, N)``; a malformed one exits 2 with its line."""
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        fail(f"--shard takes I/N (e.g. 3/8: the 4th of 8 shares), got {text!r}")
    if not 0 <= i < n:
        fail(f"--shard {text}: need 0 <= I < N")
    return i, n


def take_shard(items: Sequence[T], shard: tuple[int, int] | None) -> Sequence[T]:
    """Every N-th of ``items`` from the I-th (all of them without a shard): one GPU's share of a benchmark."""
    return items if shard is None else items[shard[0] :: shard[1]]


def check_run_flags(
    args: argparse.Namespace, name: str, policy_needs: tuple[str, str] | None = None
) -> tuple[int, int] | None:
    """The checks of the shared flags (one line, exit 2, on a mistake); returns the shard.

    ``policy_needs`` is ``(flag, why)`` for a flag that ``--policy`` cannot run without, e.g. ``("--mask-tokenizer",
    "to decode the answers' mask tokens")``.
    """
    if (args.policy is None) == (args.predictions is None):
        fail(f"cli.evaluate {name}: give --policy (run the policy) or --predictions (score a file), one")
    if policy_needs is not None and args.policy is not None:
        flag, why = policy_needs
        if getattr(args, flag.removeprefix("--").replace("-", "_")) is None:
            fail(f"cli.evaluate {name} --policy needs {flag} {why}")
    if args.batch_size < 1:
        fail(f"--batch-size must be >= 1, got {args.batch_size}")
    if args.max_new_tokens is not None and args.max_new_tokens < 1:
        fail(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    return parse_shard(args.shard) if args.shard else None


def run_info(args: argparse.Namespace, command: str, max_new_tokens: int, **extra: Any) -> dict[str, Any]:
    """The results' record of how they were made: ``extra`` (the benchmark's own settings) and then the policy, its
    mask tokenizer (where the benchmark has one), the answer budget, the shard, the scored files and the command.
    ``load_policy_on_device`` adds the device."""
    info = {**extra, "policy": args.policy}
    if hasattr(args, "mask_tokenizer"):
        info["mask_tokenizer"] = args.mask_tokenizer
    return {
        **info,
        "max_new_tokens": max_new_tokens,
        "shard": args.shard,
        "scored_files": args.predictions,
        "command": command,
    }


def load_policy_on_device(args: argparse.Namespace, info: dict[str, Any], mask_tokens: bool = True) -> tuple[Any, Any]:
    """The ``--policy`` checkpoint and its processor in ``--dtype`` on ``--device`` (cuda when available), in eval
    mode; ``info["device"]`` records the device. ``mask_tokens`` makes sure the policy can write mask tokens (a no-op
    for a policy that has them, so a fresh one can be run too)."""
    import torch

    model, processor = load_policy(args.policy, dtype=args.dtype)
    if mask_tokens:
        add_mask_tokens(model, processor)
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).eval()
    info["device"] = device
    return model, processor


def log_line(line: str) -> None:
    """A progress line on stderr, flushed at once (stdout keeps only the summary)."""
    print(line, file=sys.stderr, flush=True)


def open_judge(args: argparse.Namespace, max_tokens: int, max_concurrency: int = 4) -> Any:
    """A ``JudgeClient`` for ``--judge-url`` (None without one), with the ``--judge-*`` flags' settings."""
    if args.judge_url is None:
        return None
    cfg = JudgeConfig(
        base_url=args.judge_url,
        model=args.judge_model,
        timeout_s=args.judge_timeout,
        max_concurrency=max_concurrency,
        max_tokens=max_tokens,
        on_failure=args.judge_on_failure,
    )
    return JudgeClient(cfg)


def with_judge(judge: Any, run: Callable[[Any], T]) -> T:
    """``run(judge)``, closing the judge afterwards; an unreachable judge under ``--judge-on-failure raise`` exits 4
    with its one line."""
    try:
        return run(judge)
    except JudgeUnavailable as err:
        fail(str(err).replace("set judge.on_failure: value", "pass --judge-on-failure value"), 4)
    finally:
        if judge is not None:
            judge.close()
