"""EvolvedGRPO's answer model A as a GRPO method on reasoning rows (issue 43; docs/evolved_coevolution.md).

A sample is a `datamodules.reasoning.ReasoningSample` (image, problem, answer) from `ReasoningDataModule`, not a
grounding sample, so the method sets ``grounding = False`` and evaluates itself. Per row, G completions of the user
turn ``core.math_prompts.answer_prompt(problem)`` with the row's image (the seed's EasyR1 math prompt; the module's
``--model.sampling.prompt_template`` names grounding templates and is not used). Reward (the seed's ``math.py``)::

    accuracy_weight * accuracy + format_weight * format        (0.9 and 0.1, --model.method.init_args.*)

``accuracy``: the last closed ``\\boxed{}`` of the completion matches the row's answer (`core.math_grading
.answers_match`); ``format``: ``<think>...</think>`` then a box, as the seed's ``math.py`` checks it
(`core.math_grading.format_ok`; ``format_check: strict`` the project's earlier, stricter check).

Validation and test (greedy, one completion a row, through the module's rollout engine for evaluation):
``<kind>/<set>/accuracy`` and ``<kind>/<set>/format`` per named eval set; ``train.py predict`` writes one record
per row with the same two numbers.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from typing import Any

from core import objective
from core.math_grading import accuracy_reward, extract_boxed, format_reward
from core.math_prompts import answer_prompt
from core.rollout import Rollout
from lightning_modules.engines.base import RolloutRequest, Sampling
from lightning_modules.evaluation.metrics import FormatRate
from lightning_modules.methods.base import Method, MethodHost, RewardContext, RewardTerm, Scores, _flag

__all__ = ["MathAnswer", "chat_prompt", "greedy_texts"]


def chat_prompt(processor, text: str) -> str:
    """One user turn, the image then ``text``, rendered by the processor's chat template with the generation
    prompt (the model's template decides where the image goes)."""
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": text}]}]
    return processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def greedy_texts(module: MethodHost, prompts: Sequence[str], images: Sequence[Any], max_new_tokens: int) -> list[str]:
    """One greedy completion per (prompt, image) of the module's policy, through its rollout engine for evaluation."""
    requests = [RolloutRequest(p, im, 1, i) for i, (p, im) in enumerate(zip(prompts, images))]
    engine = module.rollout_engine.for_evaluation()
    with module.gathered():  # a sharded (FSDP2) policy is gathered for generation, as for rollouts
        ro = engine.generate(
            module.policy, module.processor, requests, Sampling(max_new_tokens=max_new_tokens, greedy=True)
        )
    return list(ro.texts)


def math_accuracy(ctx: RewardContext) -> list[float]:
    """1 when the completion's last ``\\boxed{}`` matches its row's answer, else 0."""
    return accuracy_reward(ctx.texts, [s.answer for s in ctx.samples])


def math_format(ctx: RewardContext, strict: bool = False) -> list[float]:
    """1 for a ``<think>...</think>`` part followed by a ``\\boxed{}`` (`core.math_grading.format_ok`), else 0."""
    return format_reward(ctx.texts, strict)


class MathAnswer(Method):
    """The answer model's GRPO on reasoning rows (``lightning_modules.methods.math_answer.MathAnswer``).

    Args:
        accuracy_weight: weight of the accuracy term (the seed: 0.9 = 1 - format_weight).
        format_weight: weight of the format term (the seed's ``format_weight``: 0.1).
        format_check: ``seed`` (the seed's ``math.py``: spaces inside tags allowed, a second think part passes) or
            ``strict`` (one think part, no other think tag, a closed box), `core.math_grading.format_ok`.
    """

    grounding = False
    format = "math"

    def __init__(self, accuracy_weight: float = 0.9, format_weight: float = 0.1, format_check: str = "seed") -> None:
        super().__init__()
        if format_check not in ("seed", "strict"):
            raise ValueError(f"{_flag('format_check')} must be seed or strict, got {format_check!r}")
        self.strict_format = format_check == "strict"
        for arg, value in (("accuracy_weight", accuracy_weight), ("format_weight", format_weight)):
            if value < 0:
                raise ValueError(f"{_flag(arg)} must be >= 0, got {value}")
        self.accuracy_weight, self.format_weight = accuracy_weight, format_weight
        self._eval_metrics: dict[str, dict[str, Any]] = {}

    def prompt(self, processor, sample, template: str) -> str:
        return chat_prompt(processor, answer_prompt(sample.problem))

    def reward_terms(self) -> list[RewardTerm]:
        return [
            RewardTerm("accuracy", self.accuracy_weight, math_accuracy),
            RewardTerm("format", self.format_weight, partial(math_format, strict=self.strict_format)),
        ]

    def train_logs(self, scores: Scores, ro: Rollout) -> dict[str, float]:
        acc = scores.parts["accuracy"]
        all_correct, all_wrong = objective.group_convergence(acc, ro.group_ids, 0.5)
        boxed = [extract_boxed(t) is not None for t in ro.texts]
        return {
            "train/accuracy": float(acc.mean()),
            "train/format_rate": float(scores.parts["format"].mean()),
            "train/boxed_rate": sum(boxed) / max(len(boxed), 1),
            "train/all_correct_frac": all_correct,
            "train/all_wrong_frac": all_wrong,
        }

    # ------------------------------------------------------------------------------------------------ evaluation
    def _greedy(self, module: MethodHost, batch) -> list[str]:
        prompts = [self.prompt(module.processor, s, self.ctx.eval_template) for s in batch]
        return greedy_texts(module, prompts, [s.image for s in batch], self.ctx.max_new_tokens)

    def evaluate(self, module: MethodHost, kind: str, name: str, batch) -> bool:
        """Greedy accuracy and format rate of the batch into set ``kind/name``'s metrics (logged by `eval_logs`)."""
        texts = self._greedy(module, batch)
        key = f"{kind}/{name}"
        if key not in self._eval_metrics:  # on the module's device: a multi-GPU sync (NCCL) reduces CUDA states
            self._eval_metrics[key] = {
                "accuracy": FormatRate().to(module.device),
                "format": FormatRate().to(module.device),
            }
        mets = self._eval_metrics[key]
        mets["accuracy"].update([a >= 1.0 for a in accuracy_reward(texts, [s.answer for s in batch])])
        mets["format"].update([f >= 1.0 for f in format_reward(texts, self.strict_format)])
        return True

    def eval_logs(self, kind: str) -> dict[str, float]:
        """Every set's ``{kind}/{set}/accuracy`` and ``.../format`` of the epoch (a set without rows left out), then
        reset."""
        out = {}
        for key, mets in self._eval_metrics.items():
            if key.startswith(f"{kind}/"):
                for metric, m in mets.items():
                    value = float(m.compute())
                    if value == value:  # nan: no rows this epoch
                        out[f"{key}/{metric}"] = value
                    m.reset()
        return out

    def predict(self, module: MethodHost, batch) -> list[dict]:
        """Per row: the greedy completion, its boxed answer, the gold answer, and the accuracy and format rewards."""
        texts = self._greedy(module, batch)
        acc = accuracy_reward(texts, [s.answer for s in batch])
        fmt = format_reward(texts, self.strict_format)
        return [
            {
                "sample_id": s.sample_id,
                "task": "math",
                "problem": s.problem,
                "completion": t,
                "answer": extract_boxed(t),
                "gold": s.answer,
                "format_ok": f >= 1.0,
                "rewards": {"accuracy": float(a), "format": float(f)},
            }
            for s, t, a, f in zip(batch, texts, acc, fmt)
        ]
