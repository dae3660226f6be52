"""The toy world's fixed yardstick (issue 40): what a toy checkpoint scores, and how much room RL has above it.

    python bench/toy_yardstick.py [CHECKPOINT ...] [--scenes 512] [--group 6] [--probe 128] [--template toy]
                                  [--out result.json]

Fixed once and not tuned afterwards (experiments/toy_yardstick.md says why each choice):

* **Splits**: the toy world's in-domain ``val`` and out-of-domain ``ood`` splits, ``--scenes`` (512) scenes each at
  seed 0 (the first 64 are the scenes ``configs/tiny.yaml`` validates on; the train split is drawn from another seed
  stream, so none of them is trained on).
* **Primary metric**: greedy Acc@0.5 (IoU of the answer's first box with the target >= 0.5), mIoU beside it, under the
  toy prompt at the tiny configs' length limit (96 new tokens); ``--template vlm_r1`` for a checkpoint trained under
  VLM-R1's prompt (the GRPO baselines), compared with the start under the same prompt.
* **Headroom**: ``--group`` (G = 6, the tiny configs' G) completions per scene at temperature 1: pass@G (any of the G
  at IoU >= 0.5) against greedy. If pass@G is not far above greedy, a group rarely holds a better answer than the
  policy's usual one and GRPO has little to find.
* **Response diversity**: over the first ``--probe`` (128) ``val`` scenes, the variance of correctness (IoU >= 0.5) of
  the G sampled answers of each scene, averaged over scenes: 0 when every group agrees (all right or all wrong: zero
  advantage, the paper's "diversity collapse"), 0.25 at most.
* **Greedy error kinds** (a reading aid beside the figures above, added 2026-12-06): each greedy answer is matched
  to the scene object it overlaps most: ``right`` (the target, IoU >= 0.5), ``target_loose`` (the target, IoU < 0.5),
  ``distractor`` (another object, IoU >= 0.3 with it; ``distractor_same_size`` when that object has the target's size
  but another colour and shape), ``elsewhere`` (no object) and ``no_box``. A model that reads the query's attributes
  picks a distractor rarely; one that matches the size alone picks same-size distractors.
* **Binding** (a reading aid, added 2026-12-06): greedy Acc@0.5 and error kinds on ``--bind`` (256) ``val_bind``
  scenes (seed 0), drawn as ``val`` except that every other object has the target's size: a model that matches the
  size word alone is right by chance here.
* **Format** (added 2026-12-07, issue 58): the share of the greedy and of the sampled completions whose answer
  format the prompt's own format reward accepts, and the **gate** a base passes before RL (``GATE``): greedy in
  [0.15, 0.45], pass@G >= greedy + 0.10, format >= 0.95, all on ``val``.
* **Answer-span entropy**: the mean token entropy (temperature 1) of the sampled completions over the tokens inside
  ``<answer>...</answer>`` only, so the Syn-GRPO prompt's extra fields (diversity, description) do not inflate it.

A component measurement of checkpoints (not a training figure). It prints one table and, with ``--out``, writes the
figures as JSON (the checkpoint, date, machine and command with them).
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from core import rewards  # noqa: E402
from core.boxes import iou, rescale_box  # noqa: E402
from datamodules import toy  # noqa: E402
from datamodules.rec import load_sample, read_jsonl  # noqa: E402
from lightning_modules.engines.base import rollout  # noqa: E402
from lightning_modules.engines.hf import completion_logps  # noqa: E402
from lightning_modules.evaluation.evaluator import format_for_template  # noqa: E402
from lightning_modules.models.loading import load_policy  # noqa: E402

_ANSWER = re.compile(r"<answer>.*?(?:</answer>|$)", re.S)


def answer_span_mask(tokenizer, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """[N, T] bool: the completion tokens whose characters fall inside the first ``<answer>...</answer>`` span."""
    out = torch.zeros_like(mask, dtype=torch.bool)
    for r in range(ids.shape[0]):
        n = int(mask[r].sum())
        pieces = [tokenizer.decode([int(t)]) for t in ids[r, :n]]
        ends = np.cumsum([len(p) for p in pieces])
        m = _ANSWER.search("".join(pieces))
        if m is None:
            continue
        starts = ends - np.array([len(p) for p in pieces])
        inside = (ends > m.start()) & (starts < m.end())
        out[r, :n] = torch.from_numpy(inside)
    return out


def _iou(texts, samples, input_wh, k: int) -> np.ndarray:
    gts = [s.boxes[0] for s in samples for _ in range(k)]
    orig = [s.size for s in samples for _ in range(k)]
    return np.array(rewards.rec_accuracy_reward(texts, gts, input_wh=input_wh, orig_wh=orig))


ERROR_KINDS = ("right", "target_loose", "distractor", "distractor_same_size", "elsewhere", "no_box")


def error_kinds(texts, samples, input_wh) -> dict[str, float]:
    """Shares of the ``ERROR_KINDS`` (module docstring) among greedy answers; ``distractor_same_size`` is a subset of
    ``distractor``."""
    counts = dict.fromkeys(ERROR_KINDS, 0)
    for text, s, wh in zip(texts, samples, input_wh):
        boxes = rewards.parse_completion(text).boxes
        if not boxes:
            counts["no_box"] += 1
            continue
        box = rescale_box(boxes[0], wh, s.size)
        objects = s.meta["objects"]
        overlap = [iou(box, o["box"]) for o in objects]
        best = objects[int(np.argmax(overlap))]
        if best["role"] == "target":
            counts["right" if max(overlap) >= 0.5 else "target_loose"] += 1
        elif max(overlap) >= 0.3:
            counts["distractor"] += 1
            target = next(o for o in objects if o["role"] == "target")
            if (
                best["size"] == target["size"]
                and best["colour"] != target["colour"]
                and best["shape"] != target["shape"]
            ):
                counts["distractor_same_size"] += 1
        else:
            counts["elsewhere"] += 1
    return {k: v / max(len(texts), 1) for k, v in counts.items()}


@torch.no_grad()
def measure(
    model, processor, samples, *, group: int, probe: int, batch: int, max_new_tokens: int, template: str = "toy"
) -> dict:
    """Greedy Acc@0.5 / mIoU, pass@G, the sampled Acc@0.5, response diversity and answer-span entropy of ``samples``
    (``probe``: how many of them the diversity is averaged over; 0: all)."""
    device = next(model.parameters()).device
    sampled, ent_sum, ent_n, fmt_ok, fmt_n = [], 0.0, 0, 0.0, 0
    kw = dict(template=template, max_new_tokens=max_new_tokens)
    for i in range(0, len(samples), batch):
        b = samples[i : i + batch]
        ims, qs, tasks = [s.image for s in b], [s.query for s in b], [s.task for s in b]
        sm = rollout(model, processor, ims, qs, group_size=group, do_sample=True, temperature=1.0, task=tasks, **kw)
        sampled.append(_iou(sm.texts, b, sm.input_wh, group).reshape(len(b), group))
        fmt_ok += sum(rewards.format_reward(sm.texts, format=format_for_template(template)))
        fmt_n += len(sm.texts)
        span = answer_span_mask(processor.tokenizer, sm.completion_ids, sm.completion_mask)
        for r0 in range(0, len(sm.texts), 4 * group):
            rows = list(range(r0, min(r0 + 4 * group, len(sm.texts))))
            inputs = {k: v.to(device) for k, v in sm.rows(rows).items()}
            cmask = sm.completion_mask[rows].to(device)
            _, ent = completion_logps(model, inputs, sm.completion_ids[rows].to(device), cmask, with_entropy=True)
            sel = span[rows].to(device) & cmask.bool()
            ent_sum += float(ent[sel].sum())
            ent_n += int(sel.sum())
    s_ = np.concatenate(sampled)
    right = (s_ >= 0.5).astype(float)
    probe_rows = right[: probe or len(right)]
    g = greedy(model, processor, samples, batch=batch, **kw)
    return {
        "scenes": len(samples),
        "greedy_acc50": g["greedy_acc50"],
        "greedy_miou": g["greedy_miou"],
        "pass_at_g": float(right.max(1).mean()),
        "sampled_acc50": float(right.mean()),
        "response_diversity": float(probe_rows.var(1).mean()),
        "zero_variance_frac": float((probe_rows.var(1) == 0).mean()),
        "answer_entropy": ent_sum / max(ent_n, 1),
        "sampled_format": fmt_ok / max(fmt_n, 1),
        "greedy_format": g["greedy_format"],
        "greedy_errors": g["greedy_errors"],
    }


@torch.no_grad()
def greedy(model, processor, samples, *, batch: int, max_new_tokens: int, template: str = "toy") -> dict:
    """Greedy Acc@0.5, mIoU and error kinds of ``samples`` (greedy decoding draws no random numbers, so where this
    runs does not change the sampled figures)."""
    ious, texts, whs, fmt = [], [], [], []
    for i in range(0, len(samples), batch):
        b = samples[i : i + batch]
        ims, qs, tasks = [s.image for s in b], [s.query for s in b], [s.task for s in b]
        g = rollout(
            model,
            processor,
            ims,
            qs,
            group_size=1,
            do_sample=False,
            task=tasks,
            template=template,
            max_new_tokens=max_new_tokens,
        )
        ious.append(_iou(g.texts, b, g.input_wh, 1))
        fmt.extend(rewards.format_reward(g.texts, format=format_for_template(template)))
        texts += g.texts
        whs += list(g.input_wh)
    iou_ = np.concatenate(ious)
    return {
        "greedy_acc50": float((iou_ >= 0.5).mean()),
        "greedy_miou": float(iou_.mean()),
        "greedy_errors": error_kinds(texts, samples, whs),
        "greedy_format": float(np.mean(fmt)) if fmt else 0.0,
    }


GATE = {"greedy_acc50": (0.15, 0.45), "headroom": 0.10, "format": 0.95}
"""The gate a toy base passes before RL is run from it (issue 58; docs/toy_model.md, "A base that has not seen the RL task"), read on ``val``:
greedy Acc@0.5 within ``greedy_acc50`` (room to rise), pass@G at least ``headroom`` above greedy (right answers within
reach of sampling), and the answer format valid in at least ``format`` of the sampled and of the greedy completions
(so a gain cannot come from learning the format)."""


def gate(result: dict) -> dict[str, bool]:
    """Which of ``GATE``'s conditions the yardstick ``result`` of one checkpoint meets (on ``val``)."""
    m = result["val"]
    lo, hi = GATE["greedy_acc50"]
    return {
        "greedy_in_range": lo <= m["greedy_acc50"] <= hi,
        "headroom": m["pass_at_g"] - m["greedy_acc50"] >= GATE["headroom"],
        "format": min(m["sampled_format"], m["greedy_format"]) >= GATE["format"],
    }


def evaluate(
    path: str,
    *,
    scenes: int,
    group: int,
    probe: int,
    batch: int,
    max_new_tokens: int,
    device: str,
    template: str,
    bind: int = 0,
) -> dict:
    torch.manual_seed(0)
    model, proc = load_policy(path, dtype="fp32")
    model.to(device).eval()
    with tempfile.TemporaryDirectory(prefix="toy-yardstick-") as tmp:
        data = Path(tmp)
        out: dict = {"checkpoint": path, "template": template}
        for split in ("val", "ood"):
            samples = [load_sample(r) for r in read_jsonl(toy.export_jsonl(data, split, scenes, seed=0))]
            out[split] = measure(
                model,
                proc,
                samples,
                group=group,
                probe=probe if split == "val" else 0,
                batch=batch,
                max_new_tokens=max_new_tokens,
                template=template,
            )
        if bind:
            samples = [load_sample(r) for r in read_jsonl(toy.export_jsonl(data, "val_bind", bind, seed=0))]
            g = greedy(model, proc, samples, batch=batch, max_new_tokens=max_new_tokens, template=template)
            out["val_bind"] = {"scenes": len(samples), **g}
    return out


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("checkpoints", nargs="*", default=["checkpoints/toy-qwen2.5-vl"])
    ap.add_argument("--scenes", type=int, default=512)
    ap.add_argument("--group", type=int, default=6)
    ap.add_argument("--probe", type=int, default=128)
    ap.add_argument("--bind", type=int, default=256, help="val_bind scenes for the binding reading (0: skip)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--template", default="toy", help="the prompt template: toy, or vlm_r1 for the GRPO baselines")
    ap.add_argument("--out", help="also write the figures as JSON here")
    args = ap.parse_args(argv)
    t0 = time.time()
    results = [
        evaluate(
            c,
            scenes=args.scenes,
            group=args.group,
            probe=args.probe,
            batch=args.batch,
            max_new_tokens=args.max_new_tokens,
            device=args.device,
            template=args.template,
            bind=args.bind,
        )
        for c in args.checkpoints
    ]
    print(
        f"{'checkpoint':<40} {'split':>4} {'greedy':>7} {'mIoU':>6} {'pass@G':>7} {'sampled':>8} {'div':>6} {'H_ans':>6}"
    )
    for r in results:
        for split in ("val", "ood"):
            m = r[split]
            print(
                f"{Path(r['checkpoint']).name:<40} {split:>4} {m['greedy_acc50']:7.3f} {m['greedy_miou']:6.3f} "
                f"{m['pass_at_g']:7.3f} {m['sampled_acc50']:8.3f} {m['response_diversity']:6.3f} "
                f"{m['answer_entropy']:6.3f}"
            )
            errs = ", ".join(f"{k} {v:.3f}" for k, v in m["greedy_errors"].items())
            print(f"{'':<40} {split:>4} greedy answers: {errs}")
        m = r["val"]
        r["gate"] = gate(r)
        verdict = "passes" if all(r["gate"].values()) else "fails"
        print(
            f"{'':<40} gate {verdict}: greedy {m['greedy_acc50']:.3f} in {GATE['greedy_acc50']}, pass@G - greedy "
            f"{m['pass_at_g'] - m['greedy_acc50']:+.3f} (>= {GATE['headroom']}), format sampled "
            f"{m['sampled_format']:.3f} / greedy {m['greedy_format']:.3f} (>= {GATE['format']})"
        )
        if "val_bind" in r:
            m = r["val_bind"]
            errs = ", ".join(f"{k} {v:.3f}" for k, v in m["greedy_errors"].items())
            print(f"{'':<40} bind greedy {m['greedy_acc50']:.3f} mIoU {m['greedy_miou']:.3f}; answers: {errs}")
    if args.out:
        record = {
            "what": "toy yardstick (bench/toy_yardstick.py; a component measurement of checkpoints)",
            "date": time.strftime("%Y-%m-%d"),
            "machine": f"{platform.node()} {args.device} "
            + (
                torch.cuda.get_device_name(0)
                if args.device.startswith("cuda")
                else f"{torch.get_num_threads()} threads"
            ),
            "command": "python bench/toy_yardstick.py " + " ".join(argv if argv is not None else sys.argv[1:]),
            "seconds": round(time.time() - t0, 1),
            "results": results,
        }
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
