"""EvolvedGRPO's question generator Q as a GRPO method (`lightning_modules.methods.question_generator`): its prompts,
the candidate key, the reward of each gate case worked by hand (with a scripted answer model, since the toy checkpoint
never boxes an answer), and the real frozen answer model sampled through the HF rollout engine, once per candidate."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from PIL import Image

from core.coevolution import BRIDGE, edit_kind, split_image_rows
from core.math_prompts import ANSWER_FORMAT
from datamodules.reasoning import ReasoningSample
from lightning_modules.engines.base import Sampling
from lightning_modules.engines.hf import HFRolloutEngine
from lightning_modules.grpo.step import PolicyHost
from lightning_modules.methods.base import METHODS, MethodContext
from lightning_modules.methods.question_generator import (
    GATES,
    AnswerModel,
    QuestionGenerator,
    RoundRows,
    candidate_key,
    image_hash,
    question_prompt,
    solver_prompt_with_x,
)
from lightning_modules.models.loading import load_policy

TOY_CKPT = Path(__file__).resolve().parents[2] / "checkpoints/toy-qwen2.5-vl"


def _ids(kind: str, n: int) -> list[str]:
    """The first ``n`` row ids ``q0, q1, ...`` the partition gives edit ``kind``."""
    return [i for i in (f"q{k}" for k in range(200)) if edit_kind(i) == kind][:n]


def _row(sample_id: str, answer: str = "4", colour: str = "white") -> ReasoningSample:
    return ReasoningSample(sample_id, Image.new("RGB", (56, 56), colour), "How many red shapes?", answer)


def _follow_up(text: str) -> str:
    return json.dumps({"follow_up_problem": text})


def _host(model=None, processor=None) -> PolicyHost:
    return PolicyHost(model, processor, HFRolloutEngine(), torch.device("cpu"), 0, Sampling(), None, lambda b: [])


class ScriptedAnswers(AnswerModel):
    """The answer model's interface with scripted completions (the toy checkpoint never writes a box, so the numbers
    past the gate need a script): on a vote prompt (x given) 4 x ``\\boxed{5}`` and one ``\\boxed{6}``; on the composed
    problem without x one ``\\boxed{5}`` in five; on the unedited problem three ``\\boxed{4}`` in five."""

    def __init__(self) -> None:
        super().__init__("scripted")
        self.prompts: list[str] = []

    def load(self, device, like=None) -> AnswerModel:
        return self

    def sample(self, items):
        out = []
        for _, text in items:
            self.prompts.append(text)
            if "Given: x =" in text:
                out.append(["\\boxed{5}"] * 4 + ["\\boxed{6}"])
            elif BRIDGE in text:
                out.append(["\\boxed{5}"] + ["\\boxed{7}"] * 4)
            else:
                out.append(["\\boxed{4}"] * 3 + ["no box"] * 2)
        self.prompts_sampled += len(items)
        return out


def test_prompts_ask_for_the_partitions_key_with_the_problem_and_answer():
    text = question_prompt("How many <image>red shapes?", "4", "text")
    assert (
        "How many red shapes?" in text
        and "x = 4" in text
        and text.endswith('{"follow_up_problem": "<your follow-up question>"}')
    )
    assert '{"edit_instruction": "<your instruction>"}' in question_prompt("P", "B", "image")
    composed = f"P\n\n{BRIDGE}\nFind x + 1."
    vote = solver_prompt_with_x(composed, "4")
    assert vote.startswith(composed) and "Given: x = 4" in vote and vote.endswith(ANSWER_FORMAT)


def test_the_prompt_follows_the_partition(toy_processor):
    q = QuestionGenerator()
    (text_id,), (image_id,) = _ids("text", 1), _ids("image", 1)
    assert "follow_up_problem" in q.prompt(toy_processor, _row(text_id), "toy")
    assert "edit_instruction" in q.prompt(toy_processor, _row(image_id), "toy")
    assert QuestionGenerator(image_share=1.0).kind_of(_row(text_id)) == "image"
    assert METHODS.build("question_generator").config() == q.config()
    with pytest.raises(ValueError, match="--model.method.init_args.image_share"):
        QuestionGenerator(image_share=1.5)


def test_the_default_partition_is_the_seeds_exact_split_of_the_rounds_rows(tmp_path):
    """``partition: per_round`` (the default): in a fit the training rows (the datamodule's ``train_set``, given by the
    `RoundRows` callback) are split exactly, int(0.1 * 25 + 0.5) = 3 image rows, with seed 2025 + partition_round
    (EvolvedGRPO@2dffc532 augment_dataset.py split_rows_for_augmentation; train_question_generator_8gpu.sh:
    --seed $((2025 + SOURCE_ROUND))); a row outside them takes the fixed draw; a rollout without the rows refuses to
    guess; ``partition: fixed`` is the fixed draw for every row."""
    from types import SimpleNamespace

    from datamodules.reasoning import ReasoningDataModule
    from datamodules.toy_math import ToyMathSpec

    dm = ReasoningDataModule(data_root=str(tmp_path / "toy_math"), toy=ToyMathSpec(splits={"train": 25}))
    dm.prepare_data()
    dm.setup("fit")
    rows, ids = list(dm.train_set), [r.sample_id for r in dm.train_set.records]
    trainer = SimpleNamespace(datamodule=dm)  # what the callback reads off the trainer
    with pytest.raises(RuntimeError, match="RoundRows"):
        QuestionGenerator().rollout(_host(), rows[:1])
    picked = {}
    for k in (1, 2):
        q = QuestionGenerator(partition_round=k)
        RoundRows().on_fit_start(trainer, SimpleNamespace(method=q))
        picked[k] = {r.sample_id for r in rows if q.kind_of(r) == "image"}
        assert picked[k] == split_image_rows(ids, 2025 + k) and len(picked[k]) == 3
    assert picked[1] != picked[2]  # drawn anew each round
    assert q.kind_of(_row("q-outside")) == edit_kind("q-outside")  # not a training row: the fixed draw
    fixed = QuestionGenerator(partition="fixed")
    RoundRows().on_fit_start(trainer, SimpleNamespace(method=fixed))
    assert [fixed.kind_of(r) for r in rows] == [edit_kind(i) for i in ids]
    with pytest.raises(ValueError, match="--model.method.init_args.partition"):
        QuestionGenerator(partition="sometimes")


def test_candidate_key_is_row_kind_text_and_image():
    h = image_hash(_row("a").image)
    key = candidate_key("a", "text", "Find x + 1.", h)
    assert key == candidate_key("a", "text", "Find x + 1.", image_hash(_row("b").image))  # the same pixels
    others = [
        candidate_key("b", "text", "Find x + 1.", h),
        candidate_key("a", "image", "Find x + 1.", h),
        candidate_key("a", "text", "Find x + 2.", h),
        candidate_key("a", "text", "Find x + 1.", image_hash(_row("a", colour="black").image)),
    ]
    assert len({key, *others}) == 5


def test_rewards_by_hand_with_a_scripted_answer_model():
    # Text edit: votes 4 x 5 and 1 x 6 -> label 5, p_step 0.8; without x one answer in five is 5 -> p_answer 0.2:
    #   reward = log 0.8 - log max(0.2, 0.2) + log 5 = log 20. The unedited row: 3 of 5 right -> 0.6 > 0.2: harder.
    # A second completion with the same follow-up (spaces aside) is the same candidate: A is asked once.
    # Malformed output (prose around the JSON, the other kind's key): 0. An image-edit row without an editor: 0.
    (t0,), (i0,) = _ids("text", 1), _ids("image", 1)
    q = QuestionGenerator().bind(MethodContext(group_size=2))
    q.answer = a = ScriptedAnswers()
    rows = [_row(t0), _row(t0), _row(t0), _row(t0), _row(i0), _row(i0)]
    texts = [
        _follow_up("Find x + 1."),
        '{"follow_up_problem":   "Find x + 1." }',
        "Sure! " + _follow_up("Find x + 1."),
        '{"edit_instruction": "dim the light"}',
        '{"edit_instruction": "dim the light"}',
        _follow_up("x + 1"),
    ]
    info = q.judge(_host(), rows, texts)
    scores = info["question_scores"]
    assert [s.gate for s in scores] == ["ok", "ok", "malformed", "malformed", "no_editor", "malformed"]
    assert scores[0].reward == pytest.approx(math.log(20)) and scores[0].label == "5"
    assert (scores[0].p_step, scores[0].p_answer) == (0.8, 0.2) and scores[1] == scores[0]
    assert [s.reward for s in scores[2:]] == [0.0] * 4
    assert info["harder"] == [True, True, False, False, False, False]
    assert info["base_p_answer"] == [0.6, 0.6] and info["cache"] == {"hits": 1, "misses": 1}
    assert len(a.prompts) == 3  # one vote, one success rate on the composed problem, one on the unedited row
    again = q.judge(_host(), rows, texts)
    assert len(a.prompts) == 3 and again["cache"] == {"hits": 2, "misses": 0}  # nothing sampled twice
    assert again["question_scores"] == scores and again["harder"] == info["harder"]

    # the step's reward parts and logs (a Rollout's texts and info are all `score` reads)
    ro = type("R", (), {"texts": texts, "info": info, "group_size": 2})()
    parts = q.score(rows, ro)
    assert parts.total.tolist() == pytest.approx([math.log(20)] * 2 + [0.0] * 4)
    logs = q.train_logs(parts, ro)
    assert set(f"train/q/gate/{g}" for g in GATES) <= set(logs)
    assert logs["train/q/valid_rate"] == pytest.approx(2 / 6) and logs["train/q/harder_rate"] == pytest.approx(2 / 6)
    assert logs["train/q/gate/malformed"] == pytest.approx(3 / 6) and logs["train/q/gate/no_editor"] == pytest.approx(
        1 / 6
    )
    assert logs["train/q/p_step"] == pytest.approx(0.8) and logs["train/q/p_answer"] == pytest.approx(0.2)
    assert logs["train/q/base_p_answer"] == pytest.approx(0.6) and logs["train/q/image_frac"] == pytest.approx(2 / 6)
    assert logs["train/q/cache/misses"] == 1.0


def test_no_consensus_and_few_votes_are_gated_before_any_success_rate():
    (t0,) = _ids("text", 1)

    class Split(ScriptedAnswers):
        def sample(self, items):
            self.prompts += [t for _, t in items]
            return [["\\boxed{1}", "\\boxed{2}", "\\boxed{3}", "none", "none"] for _ in items]

    q = QuestionGenerator()
    q.answer = a = Split()
    info = q.judge(_host(), [_row(t0)], [_follow_up("Find 2x.")])
    assert info["question_scores"][0].gate == "few_votes" and info["question_scores"][0].reward == 0.0
    assert len(a.prompts) == 1 and info["harder"] == [False]  # no success rate for a gated candidate


@pytest.fixture(scope="module")
def toy_processor():
    return load_policy(str(TOY_CKPT), dtype="fp32")[1]


def test_the_real_answer_model_samples_each_candidate_once_through_the_engine():
    # Q is the toy checkpoint: its outputs are never the JSON asked for, so a real step is all "malformed"; the
    # candidates below are written by hand and judged by the real frozen A (the toy checkpoint, 8 new tokens).
    model, processor = load_policy(str(TOY_CKPT), dtype="fp32")
    q = QuestionGenerator(answer_model=str(TOY_CKPT), answer_max_new_tokens=8, answer_dtype="fp32", partition="fixed")
    q.bind(MethodContext(group_size=2, max_new_tokens=8))
    t0, t1 = _ids("text", 2)
    batch = [_row(t0), _row(t1)]
    ro = q.rollout(_host(model, processor), batch)
    assert len(ro.texts) == 4 and [s.gate for s in ro.info["question_scores"]] == ["malformed"] * 4
    assert q.answer.model is None  # nothing past the JSON gate: A is not even loaded

    rows = [batch[0], batch[0], batch[1]]
    texts = [_follow_up("Find x + 1."), _follow_up("Find x + 1."), _follow_up("Find 2x.")]
    first = q.judge(_host(model, processor), rows, texts)
    assert first["cache"] == {"hits": 1, "misses": 2} and q.answer.model is not None
    assert not any(p.requires_grad for p in q.answer.model.parameters()) and q.answer.model is not model
    sampled = q.answer.prompts_sampled
    assert sampled >= 2  # the two votes (and a success rate for whatever passed the gate)
    assert all(s.gate in ("ok", "no_consensus", "few_votes") for s in first["question_scores"])
    second = q.judge(_host(model, processor), rows, texts)
    assert second["cache"] == {"hits": 3, "misses": 0} and q.answer.prompts_sampled == sampled
    assert second["question_scores"] == first["question_scores"]
    assert (q.cache.hits, q.cache.misses) == (4, 2)


def test_image_edits_through_the_editor_and_clip(tmp_path):
    # The real editor (synth.edit_client, a local procedural server: toy math edits) and a tiny random CLIP; A is
    # scripted (on the kept problem: three right answers in five). "Add some noise" is in the toy edit
    # grammar and keeps the answer; "draw a cat" is not (edit_failed). Judged twice: the second time from the cache.
    from test_clip_similarity import _tiny_clip  # tests/lightning_modules is on sys.path under pytest

    from datamodules.reasoning import ReasoningDataModule
    from datamodules.toy_math import ToyMathSpec

    _tiny_clip(tmp_path / "clip", vision_only=True)
    dm = ReasoningDataModule(data_root=str(tmp_path / "toy_math"), toy=ToyMathSpec(splits={"train": 1}))
    dm.prepare_data()
    dm.setup("fit")
    row = dm.train_set[0]
    assert row.answer == "4"  # the toy world's first row (seed 0), which the scripted A answers 3 times in 5
    editor = {"output_dir": str(tmp_path / "edits"), "timeout_s": 60}
    q = QuestionGenerator(image_share=1.0, image_editor=editor, clip_model=str(tmp_path / "clip"))
    q.answer = a = ScriptedAnswers()
    texts = ['{"edit_instruction": "Add some noise to the background."}', '{"edit_instruction": "draw a cat"}']
    try:
        first = q.judge(_host(), [row, row], texts)
        noisy, cat = first["question_scores"]
        assert cat.gate == "edit_failed" and cat.reward == 0.0
        # a noisier background barely moves the (random, tiny) CLIP embedding: p_step ~ 1; A: 3 of 5 right
        assert noisy.gate == "ok" and noisy.label == row.answer and noisy.p_step > 0.9, noisy
        assert noisy.p_answer == 0.6
        assert noisy.reward == pytest.approx(math.log(noisy.p_step) - math.log(0.6) + math.log(5))
        edited = q.cache.get(
            candidate_key(row.sample_id, "image", "Add some noise to the background.", image_hash(row.image))
        )
        assert edited.edited_image and Path(edited.edited_image).is_file()
        assert Image.open(edited.edited_image).convert("RGB").tobytes() != row.image.tobytes()
        sampled = len(a.prompts)
        again = q.judge(_host(), [row, row], texts)
        assert again["cache"] == {"hits": 2, "misses": 0} and len(a.prompts) == sampled
        assert again["question_scores"] == first["question_scores"]
    finally:
        if q._editor is not None:
            q._editor.close()
