"""EvolvedGRPO's answer model A as a GRPO method (`lightning_modules.methods.math_answer`): its two reward terms by
hand, its prompt through the toy checkpoint's chat template, its greedy validation metrics, and a GRPO step on toy
visual-math rows that moves the policy."""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from method_util import text_rollout

from core.math_prompts import ANSWER_FORMAT
from datamodules.reasoning import ReasoningDataModule, ReasoningSample
from datamodules.toy_math import ToyMathSpec
from lightning_modules.engines.base import Sampling
from lightning_modules.engines.hf import HFRolloutEngine
from lightning_modules.grpo import GRPOModule
from lightning_modules.grpo.outputs import StepOutput
from lightning_modules.grpo.step import PolicyHost
from lightning_modules.methods.base import METHODS, MethodContext, RewardTerm
from lightning_modules.methods.math_answer import MathAnswer, chat_prompt
from lightning_modules.models.loading import load_policy

TOY_CKPT = Path(__file__).resolve().parents[2] / "checkpoints/toy-qwen2.5-vl"


def _rollout(texts: list[str], group_size: int):
    return text_rollout(texts, group_size, (224, 224))


def _row(sample_id: str = "r0", answer: str = "4", image=None) -> ReasoningSample:
    from PIL import Image

    return ReasoningSample(sample_id, image or Image.new("RGB", (56, 56), "white"), "How many red shapes?", answer)


@pytest.fixture(scope="module")
def toy_policy():
    model, processor = load_policy(str(TOY_CKPT), dtype="fp32")
    return model, processor


def test_reward_is_point_nine_accuracy_plus_point_one_format_by_hand():
    # G = 4 on one row whose answer is 4:
    #   think + box 4      -> accuracy 1, format 1 -> 0.9 + 0.1 = 1.0
    #   box 4, no think    -> accuracy 1, format 0 -> 0.9
    #   think + box 5      -> accuracy 0, format 1 -> 0.1
    #   nothing            -> 0
    m = MathAnswer()
    assert METHODS.build("math_answer").config() == m.config()
    texts = ["<think>two and two</think> \\boxed{4}", "so \\boxed{4}", "<think>hm</think>\\boxed{5}", "four"]
    scores = m.bind(MethodContext(group_size=4)).score([_row()], _rollout(texts, 4))
    assert scores.parts["accuracy"].tolist() == [1.0, 1.0, 0.0, 0.0]
    assert scores.parts["format"].tolist() == [1.0, 0.0, 1.0, 0.0]
    assert scores.total.tolist() == pytest.approx([1.0, 0.9, 0.1, 0.0])
    logs = m.train_logs(scores, _rollout(texts, 4))
    assert logs["train/accuracy"] == 0.5 and logs["train/format_rate"] == 0.5 and logs["train/boxed_rate"] == 0.75
    # the group is mixed: neither all right nor all wrong
    assert logs["train/all_correct_frac"] == 0.0 and logs["train/all_wrong_frac"] == 0.0


def test_weights_are_method_arguments_and_checked():
    m = MathAnswer(accuracy_weight=1.0, format_weight=0.5)
    scores = m.bind(MethodContext(group_size=1)).score([_row()], _rollout(["<think>a</think>\\boxed{4}"], 1))
    assert scores.total.tolist() == [1.5]
    with pytest.raises(ValueError, match="--model.method.init_args.format_weight"):
        MathAnswer(format_weight=-0.1)


def test_prompt_is_the_problem_with_the_math_format_and_one_image(toy_policy):
    _, processor = toy_policy
    text = MathAnswer().prompt(processor, _row(), "toy")
    assert "How many red shapes? " + ANSWER_FORMAT in text
    assert text.count("<|image_pad|>") == 1 and text.rstrip().endswith("assistant")
    assert chat_prompt(processor, "hello") != chat_prompt(processor, "hullo")


def test_validation_logs_accuracy_and_format_per_set_and_predict_records(toy_policy):
    model, processor = toy_policy
    host = PolicyHost(model, processor, HFRolloutEngine(), torch.device("cpu"), 0, Sampling(), None, lambda b: [])
    m = MathAnswer().bind(MethodContext(max_new_tokens=8))
    batch = [_row("a"), _row("b", answer="7")]
    assert m.evaluate(host, "val", "toy_math_val", batch) is True
    logs = m.eval_logs("val")
    assert set(logs) == {"val/toy_math_val/accuracy", "val/toy_math_val/format"}
    assert all(0.0 <= v <= 1.0 for v in logs.values())
    assert m.eval_logs("val") == {}  # reset: no rows since
    records = m.predict(host, batch)
    assert [r["sample_id"] for r in records] == ["a", "b"] and records[1]["gold"] == "7"
    assert set(records[0]["rewards"]) == {"accuracy", "format"}
    from callbacks.predictions import summarize  # train.py predict's summary of a set: the same two numbers

    assert summarize(records) == {
        "accuracy": 0.5 * sum(r["rewards"]["accuracy"] for r in records),
        "format": 0.5 * sum(r["format_ok"] for r in records),
    }


class TextRewarded(MathAnswer):
    """MathAnswer plus a reward that is an arbitrary function of the text (its characters' code points mod 97): the
    toy checkpoint never answers math, so its math rewards are all 0 and a group has no advantage; distinct
    completions get distinct rewards here, so the step has a gradient and the test sees the policy move."""

    def reward_terms(self) -> list[RewardTerm]:
        text = RewardTerm("text", 1.0, lambda ctx: [sum(map(ord, t)) % 97 / 97 for t in ctx.texts])
        return super().reward_terms() + [text]


def test_a_grpo_step_on_toy_math_rows_updates_the_policy(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch.manual_seed(0)
    dm = ReasoningDataModule(
        data_root=str(tmp_path / "toy_math"), batch_size=2, toy=ToyMathSpec(splits={"train": 2, "val": 2}), seed=0
    )
    module = GRPOModule(
        policy={"model_name_or_path": str(TOY_CKPT), "dtype": "fp32"},
        sampling={"group_size": 3, "max_new_tokens": 12},
        kl={"coef": 0.01},
        method=TextRewarded(),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
    )
    seen: list[dict] = []

    class Capture(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(outputs)

    trainer = L.Trainer(
        accelerator="cpu", max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0, limit_val_batches=1, callbacks=[Capture()],
    )  # fmt: skip
    module.configure_model()
    before = {k: v.detach().clone() for k, v in module.policy.named_parameters()}
    trainer.fit(module, datamodule=dm)
    out = StepOutput.of(seen[0])
    assert all(isinstance(s, ReasoningSample) for s in out.samples) and len(out.completions) == 6
    assert out.boxes == [[]] * 6 and set(out.rewards) == {"accuracy", "format", "text", "total"}
    logged = trainer.callback_metrics
    assert {"train/reward/accuracy", "train/accuracy", "val/toy_math_val/accuracy", "val/toy_math_val/format"} <= set(
        logged
    )
    assert "train/iou" not in logged  # the REC logs stay with grounding methods
    assert logged["train/grad_norm"] > 0
    assert any(not torch.equal(before[k], v) for k, v in module.policy.named_parameters())
