"""Video benchmarks of Generalized CycleGRPO: ``python -m cli.evaluate vstar | dove ...`` (a ``BENCHMARK_MODULES``
entry of ``cli/evaluate.py``).

    python -m cli.evaluate vstar --data V_STaR_test.json --video-root videos/ --policy CKPT \\
        --judge-url http://127.0.0.1:8000/v1 --judge-model Qwen2.5-72B-Instruct --out results/vstar.json
    python -m cli.evaluate vstar ... --predictions results/vstar.predictions.jsonl --out results/vstar.json
    python -m cli.evaluate vstar ... --predictions qwen2-5_answer.json --out results/vstar.json   # V-STaR's results
    python -m cli.evaluate dove --data dove.jsonl --video-root videos/ --policy CKPT --judge-url URL --out dove.json

V-STaR (``evals/vstar.py``): the policy answers each item's what / when / where questions in
both chain orders; mAM and mLGM as V-STaR's ``eval.py`` defines them (*what* rated by the judge, or by exact match
without ``--judge-url``). DOVE (``evals/dove.py``): the policy captions each occurrence of a
contrast group, a text-only judge answers the Order / State / Outcome probes from the caption alone; TEC per probe
type, their macro average, and N/M. Both write the results to ``--out`` and every item's answers to
``<out stem>.predictions.jsonl``, which ``--predictions`` scores again (``--shard I/N`` runs every N-th item, for one
GPU's share). A data defect exits 3 with the file and item; a flag mistake or a missing file exits 2; an unreachable
judge under ``--judge-on-failure raise`` exits 4.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

from cli.errors import fail
from cli.evaluate_common import (
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
from core.prompts import PROMPT_TEMPLATES
from evals.dove import evaluate_dove, read_dove, read_dove_predictions
from evals.video_inputs import VideoIndex
from evals.vstar import VSTAR_PROMPTS, evaluate_vstar, read_vstar, read_vstar_predictions

__all__ = ["register"]


def register(sub: Any) -> None:
    """Add the ``vstar`` and ``dove`` sub-commands to ``cli.evaluate``'s sub-parsers ``sub``."""
    vstar = sub.add_parser("vstar", help="V-STaR: what / when / where in two chain orders (mAM, mLGM)")
    vstar.add_argument("--data", required=True, help="V-STaR's annotation JSON (V_STaR_test.json)")
    vstar.add_argument(
        "--prompts", default="vstar", help="question set: vstar (the benchmark's) or toy (the toy checkpoint's)"
    )
    dove = sub.add_parser("dove", help="DOVE: occurrence captions probed by a text-only judge (TEC, N/M)")
    dove.add_argument("--data", required=True, help="DOVE contrast groups as JSONL (docs/cycle_grpo.md: the format)")
    dove.add_argument(
        "--caption-template",
        default="video_caption",
        help="prompt template of the occurrence caption (video_caption; toy_caption for the toy checkpoint)",
    )
    dove.add_argument("--bootstrap", type=int, default=0, help="resamples of the groups for TEC's 95%% CI (0: none)")
    for p, handler, budget in (
        (vstar, _vstar, (256, "answer budget per question")),
        (dove, _dove, (128, "caption budget")),
    ):
        p.add_argument("--video-root", default=None, help="folder holding <vid>.mp4 (or toy <vid>.npz), searched down")
        add_run_flags(
            p,
            unit="item",
            mask_tokenizer=False,
            predictions_help="score these predictions files, not a policy",
            max_new_tokens=budget,
            batch_size=(4, "clips per generate call"),
        )
        p.add_argument("--fps", type=float, default=1.0, help="frames sampled per second of video (V-STaR: 1)")
        p.add_argument("--max-frames", type=int, default=64, help="at most this many frames, evenly spaced")
        p.add_argument("--max-pixels", type=int, default=448 * 448, help="frames larger than this are scaled down")
        add_judge_flags(
            p,
            url_help="OpenAI-compatible base URL of the judge (…/v1)",
            failure_help="value: a failed judge call scores as a wrong answer; raise: stop with one line",
        )
        p.set_defaults(handler=handler)


def _common(args: argparse.Namespace, name: str, command: str, **extra: Any) -> tuple[tuple[int, int] | None, dict]:
    """Flag checks shared by both benchmarks; the shard and the run's ``info`` (``extra`` is the benchmark's own)."""
    shard = check_run_flags(args, name, ("--video-root", "for the benchmark's videos"))
    if args.max_frames < 1:
        fail(f"--max-frames must be >= 1, got {args.max_frames}")
    if not args.fps > 0:
        fail(f"--fps must be > 0, got {args.fps}")
    judge = {"judge_url": args.judge_url, "judge_model": args.judge_model if args.judge_url else None}
    return shard, run_info(args, command, args.max_new_tokens, **judge, fps=args.fps, **extra)


def _inputs(args: argparse.Namespace, info: dict, read_predictions: Callable[[list[str]], dict]) -> dict[str, Any]:
    """The keyword arguments both ``evaluate_vstar`` and ``evaluate_dove`` take: the ``--predictions`` read by
    ``read_predictions``, or the policy on its device with the videos under ``--video-root``; the frame sampling."""
    model = processor = videos = predictions = None
    if args.predictions is not None:
        predictions = read_predictions(args.predictions)
    else:
        videos = VideoIndex(args.video_root)
        model, processor = load_policy_on_device(args, info, mask_tokens=False)
    return dict(
        model=model, processor=processor, videos=videos, predictions=predictions, fps=args.fps,
        max_frames=args.max_frames, max_pixels=args.max_pixels, max_new_tokens=args.max_new_tokens,
        batch_size=args.batch_size, info=info, log=log_line,
    )  # fmt: skip


def _vstar(args: argparse.Namespace, command: str) -> int:
    if args.prompts not in VSTAR_PROMPTS:
        fail(f"--prompts {args.prompts!r}: one of {sorted(VSTAR_PROMPTS)}")
    shard, info = _common(args, "vstar", command, prompts=args.prompts)
    items = take_shard(read_vstar(args.data, max_samples=args.max_samples), shard)
    inputs = _inputs(args, info, read_vstar_predictions)
    results = with_judge(
        open_judge(args, max_tokens=16),
        lambda judge: evaluate_vstar(items, args.out, judge=judge, prompts=args.prompts, **inputs),
    )
    m = results["metrics"]
    print(
        f"vstar: {results['n']} items, what by {results['what_scorer']}: acc {m['acc']:.4f}; chain 1 when "
        f"{m['when']:.4f} where {m['where']:.4f}; chain 2 where {m['where_2']:.4f} when {m['when_2']:.4f}; "
        f"mAM {m['mAM']:.4f} mLGM {m['mLGM']:.4f}"
    )
    print(f"wrote {args.out} and {results['predictions']}")
    return 0


def _dove(args: argparse.Namespace, command: str) -> int:
    if args.caption_template not in PROMPT_TEMPLATES:
        fail(
            f"--caption-template {args.caption_template!r} is not a prompt template; one of {sorted(PROMPT_TEMPLATES)}"
        )
    if args.judge_url is None:
        fail("cli.evaluate dove needs --judge-url: the probes are answered by a text-only judge LLM from the caption")
    if args.bootstrap < 0:
        fail(f"--bootstrap must be >= 0, got {args.bootstrap}")
    shard, info = _common(args, "dove", command, caption_template=args.caption_template)
    groups = take_shard(read_dove(args.data, max_samples=args.max_samples), shard)
    inputs = _inputs(args, info, read_dove_predictions)
    results = with_judge(
        open_judge(args, max_tokens=16),
        lambda judge: evaluate_dove(
            groups, args.out, judge=judge, caption_template=args.caption_template, bootstrap=args.bootstrap, **inputs
        ),
    )
    m = results["metrics"]
    per_type = ", ".join(f"{t} {m['tec_by_type'][t]:.4f}" for t in m["tec_by_type"])
    print(
        f"dove: {results['n_occurrences']} occurrences, {m['n_probes']} probes: TEC {m['tec']:.4f} ({per_type}), N/M {m['nm']:.4f}"
    )
    print(f"wrote {args.out} and {results['predictions']}")
    return 0
