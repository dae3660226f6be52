"""SFTModule's validation and test: each kind of example answered greedily and scored as the RL run will score it.

`SFTEvaluation.evaluate` returns a batch's values as ``{"<kind>/<set>/<metric>": (value, count)}`` (the module logs
them as epoch means), by the batch's kind (`sft_examples`):

- **images**: the shared greedy evaluation (``evaluation.Evaluator``: Acc@0.5, mIoU, format rate in the template's own
  answer format, as `GRPOModule` logs them), the sampled (temperature 1) format rate ``format_sampled`` (what GRPO
  starts from) and, with ``caption_frac``, the greedy cycle's ``cycle_acc50``;
- **clips**: CycleGRPO's own clip validation in every region space of ``video_spaces``
  (``CycleEvaluation.evaluate_clips``), accumulated and logged at the epoch's end (`SFTEvaluation.epoch_logs`) as
  ``<kind>/<set>/<space>/<metric>``;
- **mask-token examples**: ``MaskSFT.evaluate``;
- **toy math pairs**: A's rows ``accuracy`` and ``format`` (as ``MathAnswer`` validates), Q's rows ``valid_json``
  (``QuestionGenerator``'s gate) and ``in_grammar`` (an edit the toy world executes: ``sft_math.edit_in_grammar``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from core import rewards
from core.coevolution import EDIT_KEYS
from core.math_grading import answers_match, extract_boxed, format_ok
from core.question_rewards import parse_question_output
from datamodules.sft_math import edit_in_grammar
from lightning_modules.engines.base import RolloutRequest, Sampling, build_rollout_engine, rollout
from lightning_modules.evaluation.evaluator import Evaluator, format_for_template, greedy_answers
from lightning_modules.methods.cycle_rewards import caption_text
from lightning_modules.sft_examples import SFTExamples, pair_prompt

__all__ = ["SFTEvaluation"]

Logs = dict[str, tuple[Any, int]]
"""Metric key -> (value, the number of rows it is the mean of)."""


class SFTEvaluation:
    """The greedy evaluation of `SFTModule` (module docstring): the examples' settings, the module's REC / OVD
    ``evaluator`` (a submodule of the module, where Lightning finds the metric objects it logs) and the generation
    length ``max_new_tokens``."""

    def __init__(self, examples: SFTExamples, evaluator: Evaluator, max_new_tokens: int) -> None:
        self.examples, self.evaluator, self.max_new_tokens = examples, evaluator, max_new_tokens

    def evaluate(self, policy, processor, batch, kind: str, name: str, device) -> Logs:
        """The values of a validation / test batch of eval set ``name`` (module docstring)."""
        if batch and hasattr(batch[0], "clip"):
            self._clips(policy, processor, batch, kind, name, device)
            return {}
        if self.examples.mask_sft is not None:  # the mask-token examples, greedily (MaskSFT.evaluate)
            return self.examples.mask_sft.evaluate(policy, processor, batch, self.max_new_tokens, f"{kind}/{name}")
        if batch and hasattr(batch[0], "completion"):
            return self._pairs(policy, processor, batch, kind, name)
        return self._images(policy, processor, batch, kind, name)

    def greedy(self, policy, processor, batch) -> list:
        """Greedy answers to image samples under the first training template, as validation reads them (the held-out
        summary's reading, callbacks/heldout.py)."""
        return greedy_answers(
            policy, processor, batch, template=self.examples.first_template, max_new_tokens=self.max_new_tokens
        )[0]

    def epoch_logs(self, trainer, kind: str) -> dict[str, float]:
        """The epoch's values of every eval set of ``kind`` that are not batch means (the evaluator's detection and
        GRES metrics, the clips' metrics), then reset."""
        out = self.evaluator.detection(trainer, kind)
        for space in self.examples.video_spaces:
            out.update(self.examples.video_method(space).eval_logs(kind))
        return out

    def _images(self, policy, processor, batch, kind: str, name: str) -> Logs:
        first, n = self.examples.first_template, self.max_new_tokens
        answers = self.greedy(policy, processor, batch)
        logs = self.evaluator.update(kind, name, batch, answers, format=format_for_template(first))
        out: Logs = {k: (v, len(batch)) for k, v in logs.items()}
        sampled = rollout(
            policy,
            processor,
            [s.image for s in batch],
            [s.query for s in batch],
            group_size=1,
            task=[s.task for s in batch],
            template=first,
            max_new_tokens=n,
            do_sample=True,
            temperature=1.0,
        )
        fmt = rewards.format_reward(sampled.texts, format=format_for_template(first))
        targets = [s for s in batch if s.boxes]  # the cycle runs on the samples with a target
        if self.examples.caption_frac and targets:
            out[f"{kind}/{name}/cycle_acc50"] = (self._cycle_acc50(policy, processor, targets, first), len(targets))
        out[f"{kind}/{name}/format_sampled"] = (sum(fmt) / len(batch), len(batch))
        return out

    def _cycle_acc50(self, policy, processor, batch, template: str) -> float:
        """The greedy cycle: caption each target's box, ground the caption (coordinates stripped, as CycleGRPO
        grounds it) under ``template``; the fraction that lands back on the target at IoU >= 0.5."""
        n = self.max_new_tokens
        asked = [replace(s, query=self.examples.caption_query(processor, s)) for s in batch]
        captions, _ = greedy_answers(
            policy, processor, asked, template=self.examples.caption_template, max_new_tokens=n
        )
        back = [replace(s, query=caption_text(a.text)) for s, a in zip(batch, captions)]
        answers, _ = greedy_answers(policy, processor, back, template=template, max_new_tokens=n)
        hits = [bool(a.boxes) and rewards.iou(a.boxes[0], s.boxes[0]) >= 0.5 for s, a in zip(batch, answers)]
        return sum(hits) / max(len(batch), 1)

    def _pairs(self, policy, processor, batch, kind: str, name: str) -> Logs:
        """Toy math pairs, greedily (module docstring)."""
        requests = [RolloutRequest(pair_prompt(processor, s), s.image, 1, i) for i, s in enumerate(batch)]
        sampling = Sampling(max_new_tokens=self.max_new_tokens, greedy=True)
        texts = build_rollout_engine("hf").generate(policy, processor, requests, sampling).texts
        scores: dict[str, list[float]] = {}
        for s, text in zip(batch, texts):
            if s.role == "answer":
                row = {"accuracy": answers_match(extract_boxed(text), s.answer), "format": format_ok(text)}
            else:
                out = parse_question_output(text, EDIT_KEYS[s.kind])
                row = {"valid_json": out is not None, "in_grammar": out is not None and edit_in_grammar(s, out.text)}
            for k, v in row.items():
                scores.setdefault(k, []).append(float(v))
        return {f"{kind}/{name}/{k}": (sum(v) / len(v), len(v)) for k, v in scores.items()}

    def _clips(self, policy, processor, batch, kind: str, name: str, device) -> None:
        """Clips, greedily, in every region space of ``video_spaces``: CycleGRPO's own clip validation in that space
        (the grounding of each query under the space's ``video_templates`` prompt, then the cycle on each target
        moment), so this stage reports what the RL run on its checkpoint will."""
        engine = build_rollout_engine("hf")
        for space in self.examples.video_spaces:
            m, template = self.examples.video_method(space), self.examples.video_templates[space]
            key = f"{kind}/{name}/{space}"
            m.evaluation.evaluate_clips(policy, processor, engine, batch, key, template, self.max_new_tokens, device)
