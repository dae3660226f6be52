"""One greedy evaluation path for every module and callback: answers, their metrics, the names they are logged under.

`greedy_answers` generates one greedy completion per sample through a registered rollout engine and reads it back
(parsed completion, boxes in the image's original pixels). `Evaluator` keeps the torchmetrics of every named eval set
(``val/<set>/acc50``, ``miou``, ``format``; OVD: ``map``, ``map_50``, ``gp``, ``gr``; a set with no-target queries
adds GRES's ``giou``, ``ciou``, ``n_acc``, ``t_acc``, its no-target queries scored by these alone) and is what
`GRPOModule` and `SFTModule` log, so both report the same numbers for the same answers; the galleries draw the same
answers.
The format rate checks the answer format of the method being evaluated (``format``), so each method is scored in
its own format; set one ``eval_prompt_template`` / ``eval_format`` for every method to compare them under one.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from core import rewards
from core.regions import NO_TARGET, region_space
from core.rollout import Rollout
from datamodules import evolve
from lightning_modules.engines.base import RolloutEngine, RolloutRequest, Sampling, build_rollout_engine
from lightning_modules.evaluation.cycle_metrics import RegionGroundingMetrics
from lightning_modules.evaluation.metrics import DetectionMetrics, FormatRate, GroundingAccuracy, MeanIoU
from lightning_modules.models.prompts import build_prompt_text

__all__ = [
    "Answer",
    "Evaluator",
    "answered_region",
    "eval_set_name",
    "format_for_template",
    "greedy_answers",
    "has_no_target",
    "rec_records",
    "step_scores",
]


def format_for_template(template: str) -> str:
    """The answer format a prompt template asks for (``rewards.FORMATS``): VLM-R1's think + answer, else the
    four-part format (Syn-GRPO's and the toy model's)."""
    return "think_answer" if template == "vlm_r1" else "syn_grpo"


@dataclass
class Answer:
    """One sample's greedy answer: text, parsed form, boxes in original pixels, the model-input size."""

    text: str
    parsed: rewards.ParsedCompletion
    boxes: list[list[float]]
    input_wh: tuple[int, int]


@torch.no_grad()
def greedy_answers(
    model,
    processor,
    samples: Sequence[Any],
    *,
    template: str,
    max_new_tokens: int,
    engine: str | RolloutEngine = "hf",
) -> tuple[list[Answer], Rollout]:
    """Greedy answers of ``model`` to ``samples`` (each with ``image``, ``query``, ``task``, ``size``) under prompt
    ``template``, through rollout engine ``engine`` (a registered name, or the module's own engine instance: a vLLM
    server engine evaluates on its server)."""
    requests = [
        RolloutRequest(build_prompt_text(processor, s.query, task=s.task, template=template), s.image, 1, i)
        for i, s in enumerate(samples)
    ]
    engine = build_rollout_engine(engine) if isinstance(engine, str) else engine
    ro = engine.generate(model, processor, requests, Sampling(max_new_tokens=max_new_tokens, greedy=True))
    answers = []
    for s, text, in_wh in zip(samples, ro.texts, ro.input_wh):
        parsed = rewards.parse_completion(text)
        answers.append(Answer(text, parsed, [rewards.rescale_box(b, in_wh, s.size) for b in parsed.boxes], in_wh))
    return answers, ro


def eval_set_name(trainer, kind: str, dataloader_idx: int) -> str:
    """The name of eval set ``dataloader_idx`` of ``kind`` (``val`` / ``test``) from the datamodule."""
    names = eval_set_names(trainer, kind)
    return names[dataloader_idx] if dataloader_idx < len(names) else f"set{dataloader_idx}"


def eval_set_names(trainer, kind: str) -> list[str]:
    dm = getattr(trainer, "datamodule", None) if trainer is not None else None
    names = dm.eval_names(kind) if dm is not None and hasattr(dm, "eval_names") else []
    return names or ["default"]


def has_no_target(dataset) -> bool:
    """Whether an eval set (its ``records``) holds REC queries without a target (solution ``[]``)."""
    return any(r.task == "rec" and not r.boxes for r in getattr(dataset, "records", []))


def answered_region(text: str, parsed: rewards.ParsedCompletion, input_wh, size, space=None):
    """A grounding answer on an image as a box-space region in the original pixels of an image of ``size``: the
    answer part's first box (``parsed``), else what the box space (``space``, default ``box``) parses from the whole
    text (a box; ``NO_TARGET`` for "no target" and close phrasings), else None (unreadable). CycleGRPO's grounding
    reward reads image answers with it, and the evaluator's GRES metrics score them with it."""
    if parsed.boxes:
        return tuple(rewards.rescale_box(parsed.boxes[0], input_wh, size))
    pred = (space or region_space("box")).parse(text)
    if pred is not None and pred is not NO_TARGET:
        return tuple(rewards.rescale_box(list(pred), input_wh, size))
    return pred


def step_scores(sample, text: str, input_wh, iou_threshold: float = 0.5) -> dict[str, Any] | None:
    """How the ``<step>`` boxes of a greedy answer to a multi-step toy question (``evolve.query_steps``: anchor first,
    target last; a guided sub-problem question counts as its question) score against the question's chain, or None
    when the sample has no chain of two or more steps: ``n`` gold steps, ``written`` steps, ``prefix_credit`` (the
    process reward's fraction of steps in the longest correct prefix) and ``step1`` (the anchor's box at IoU >= 0.5).
    ``train.py predict`` records it, so a held-out multi-step split shows whether the steps are grounded or only
    written (docs/evolved_grpo.md)."""
    if sample.task != "rec" or not sample.meta:
        return None
    chain = [st.box for st in evolve.query_steps(sample.meta, sample.query)]
    if len(chain) < 2:
        return None
    pred = evolve.written_steps(text, input_wh, sample.size)
    return {
        "n": len(chain),
        "written": len(pred),
        "prefix_credit": evolve.prefix_credit(pred, chain, iou_threshold),
        "step1": evolve.prefix_credit(pred[:1], chain[:1], iou_threshold) == 1.0,
    }


def rec_records(samples: Sequence[Any], answers: Sequence[Answer], *, format: str) -> list[dict]:
    """``train.py predict``'s REC / OVD records (`GRPOModule.predict_step`): per sample its greedy answer, the
    answer's boxes, the ground truth, whether it follows answer format ``format``, and its accuracy and format rewards
    (a no-target query: 1 for answering "no target"; a multi-step question adds its `step_scores`)."""
    fmt = rewards.format_reward([a.text for a in answers], format=format, parsed=[a.parsed for a in answers])
    out = []
    for s, a, f in zip(samples, answers, fmt):
        extra = {}
        if s.task == "rec" and not s.boxes:  # a no-target query: 1 for answering "no target" (GRES's N-acc)
            rejected = answered_region(a.text, a.parsed, a.input_wh, s.size) is NO_TARGET
            acc, extra = float(rejected), {"no_target": True, "rejected": rejected}
        elif s.task == "rec":
            region = answered_region(a.text, a.parsed, a.input_wh, s.size)
            extra = {"answered": region is not None and region is not NO_TARGET}  # T-acc, as the evaluator's
            acc = rewards.iou(a.boxes[0], s.boxes[0]) if a.boxes else 0.0
            steps = step_scores(s, a.text, a.input_wh)
            if steps is not None:
                extra["steps"] = steps
        else:
            acc = rewards.ovd_reward([a.text], [s.boxes], input_wh=[a.input_wh], orig_wh=[s.size])[0]
        out.append(
            {
                "sample_id": s.sample_id,
                "task": s.task,
                "query": s.query,
                "completion": a.text,
                "boxes": a.boxes,
                "gt_boxes": s.boxes,
                "format_ok": f >= 1.0,
                "rewards": {"accuracy": float(acc), "format": float(f)},
                **extra,
            }
        )
    return out


class Evaluator(nn.Module):
    """The metrics of every named eval set, as submodules (Lightning finds logged metrics by attribute, so they are
    built in ``setup`` before the first ``log``)."""

    def __init__(self) -> None:
        super().__init__()
        self.sets = nn.ModuleDict()

    def build(self, trainer, stage: str) -> None:
        dm = getattr(trainer, "datamodule", None)
        for kind in {"fit": ["val"], "validate": ["val"], "test": ["test"]}.get(stage, []):
            for name in eval_set_names(trainer, kind):
                key = f"{kind}__{name}"
                if key not in self.sets:
                    self.sets[key] = nn.ModuleDict(
                        {
                            "acc50": GroundingAccuracy(0.5),
                            "miou": MeanIoU(),
                            "format": FormatRate(),
                            "det": DetectionMetrics(),
                        }
                    )
                    ds = getattr(dm, "eval_sets", {}).get(kind, {}).get(name) if dm is not None else None
                    if ds is not None and has_no_target(ds):  # GRES's metrics: gIoU, cIoU, N-acc, T-acc
                        self.sets[key]["region"] = RegionGroundingMetrics("box")

    def update(self, kind: str, name: str, samples: Sequence[Any], answers: Sequence[Answer], *, format: str):
        """Update set ``kind/name`` with the answers; returns the metric objects to log (``self.log_dict``)."""
        mets = self.sets[f"{kind}__{name}"]
        fmt = rewards.format_reward([a.text for a in answers], format=format, parsed=[a.parsed for a in answers])
        mets["format"].update(torch.tensor([f >= 1.0 for f in fmt]))
        for s, a in zip(samples, answers):
            if "region" in mets and s.task == "rec":  # every REC sample, no-target ones included (a rejection is 1)
                gt = tuple(s.boxes[0]) if s.boxes else NO_TARGET
                mets["region"].update([gt], [answered_region(a.text, a.parsed, a.input_wh, s.size)])
            if s.task == "rec" and not s.boxes:  # a no-target query: only the GRES metrics score it
                continue
            if s.task == "rec":
                pred = torch.tensor([a.boxes[0]], dtype=torch.float32)[0] if a.boxes else None
                gt = torch.tensor([s.boxes[0]], dtype=torch.float32)
                mets["acc50"].update([pred], gt)
                mets["miou"].update([pred], gt)
            else:
                mets["det"].update(a.boxes, s.boxes)
        logs = {f"{kind}/{name}/format": mets["format"]}
        if samples and samples[0].task != "ovd":
            logs.update({f"{kind}/{name}/acc50": mets["acc50"], f"{kind}/{name}/miou": mets["miou"]})
        return logs

    def detection(self, trainer, kind: str) -> dict[str, float]:
        """mAP / GP / GR of every OVD set and gIoU / cIoU / N-acc / T-acc of every set with no-target queries, then
        reset. ``compute()`` is a collective: every rank walks the same sets
        (taken from the datamodule, identical on all ranks) in the same order."""
        dm = getattr(trainer, "datamodule", None)
        sets = getattr(dm, "eval_sets", {}).get(kind, {}) if dm is not None else {}
        out = {}
        for name, ds in sets.items():
            key = f"{kind}__{name}"
            if key in self.sets and "region" in self.sets[key]:  # a set with no-target queries
                for k, v in self.sets[key]["region"].compute().items():
                    if not torch.isnan(v):
                        out[f"{kind}/{name}/{k}"] = float(v)
                self.sets[key]["region"].reset()
            if not ds.records or ds.records[0].task != "ovd" or key not in self.sets:
                continue
            res = self.sets[key]["det"].compute()
            for k in ("map", "map_50", "gp", "gr"):
                out[f"{kind}/{name}/{k}"] = float(res[k])
            self.sets[key]["det"].reset()
        return out
