"""The toy math SFT stage's targets and data (datamodules/sft_math.py) and SFTModule's encoding of its pairs.

Literal targets for a count row, a bar row and a composed row; every A target of real toy math rows passes the
format check and grades correct against its row's answer; every Q target passes Q's JSON gate with the row's key and
its edit is one the toy world executes (a follow-up ``parse_follow_up`` reads, an instruction that keeps the answer).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from core.coevolution import EDIT_KEYS, compose_follow_up
from core.math_grading import answers_match, extract_boxed, format_ok
from core.question_rewards import parse_question_output
from core.toy_math import parse_follow_up
from core.toy_math.edits import edit_problem
from datamodules.reasoning import ReasoningSample
from datamodules.sft_math import (
    SFTReasoningDataModule,
    answer_target,
    edit_in_grammar,
    edit_instruction_target,
    follow_up_target,
    math_pair,
)
from datamodules.toy_math import ToyMathSpec, make_row

REPO = Path(__file__).resolve().parents[2]


def _shape(colour: str, shape: str) -> dict:
    return {"colour": colour, "shape": shape, "box": [0, 0, 10, 10]}


SHAPES = {
    "kind": "shapes",
    "size": 224,
    "objects": [_shape("red", "circle"), _shape("red", "circle"), _shape("red", "star"), _shape("blue", "circle")],
}
BARS = {
    "kind": "bars",
    "size": 224,
    "max_value": 6,
    "bars": [{"colour": c, "value": v} for c, v in (("green", 2), ("red", 5), ("blue", 3))],
}


def _sample(row: dict) -> ReasoningSample:
    return ReasoningSample(row["id"], row["image"], row["problem"], row["answer"], meta=row["meta"])


def test_a_count_row_counts_by_the_open_attribute_then_adds():
    meta = {"scene": SHAPES, "query": {"op": "count", "colour": "red", "shape": None}}
    assert answer_target(meta, "3") == "<think>I count 2 red circles and 1 red star. 2 + 1 = 3.</think> \\boxed{3}"
    diff = {"scene": SHAPES, "query": {"op": "count_diff", "a": "red", "b": "blue"}}
    assert answer_target(diff, "2") == "<think>I count 3 red shapes and 1 blue shape. 3 - 1 = 2.</think> \\boxed{2}"


def test_a_bar_row_reads_the_bars_then_sums():
    meta = {"scene": BARS, "query": {"op": "bar_total"}}
    assert answer_target(meta, "10") == "<think>The bars are 2, 5, 3. 2 + 5 + 3 = 10.</think> \\boxed{10}"


def test_a_composed_row_gives_x_then_each_follow_up_step():
    meta = {"scene": BARS, "query": {"op": "bar_range"}, "follow_ups": [{"op": "mul", "k": 4}, {"op": "rsub", "k": 20}]}
    assert answer_target(meta, "8") == (
        "<think>The tallest bar is 5 and the shortest is 2. 5 - 2 = 3. So x = 3 and 4 * 3 = 12. "
        "So x = 12 and 20 - 12 = 8.</think> \\boxed{8}"
    )


def test_q_text_target_is_one_json_key_with_a_follow_up_of_the_grammar():
    texts = {follow_up_target(np.random.default_rng(i)) for i in range(200)}
    for text in texts:
        out = parse_question_output(text, EDIT_KEYS["text"])
        assert out is not None and parse_follow_up(out.text) is not None, text
    assert len(texts) >= 40  # seeded, but varied: Q is not taught one follow-up
    assert len({parse_follow_up(json.loads(t)["follow_up_problem"]).op for t in texts}) == 5


def test_q_image_target_is_an_instruction_that_keeps_the_answer():
    row = make_row("train", 0, seed=1)  # a count row: moves, resizes, backgrounds and noise may apply
    seen = set()
    for i in range(12):
        out = parse_question_output(edit_instruction_target(row["meta"], np.random.default_rng(i)), "edit_instruction")
        assert out is not None
        edited = edit_problem(row["meta"], out.text)  # raises if outside the grammar or answer-changing
        assert edited["scene"] != row["meta"]["scene"]
        seen.add(out.text)
    assert len(seen) >= 6


def test_every_target_of_real_rows_is_well_formed_correct_and_in_grammar():
    kinds = {"text": 0, "image": 0}
    composed = 0
    for i in range(48):
        sample = _sample(make_row("train", i, seed=1))
        a = math_pair(sample, "answer", seed=0, follow_share=0.5)
        assert format_ok(a.completion) and answers_match(extract_boxed(a.completion), a.answer), a.completion
        composed += a.problem != sample.problem
        if a.problem != sample.problem:  # the composed problem is the row's, followed up as Q's text edits do
            assert a.problem.startswith(compose_follow_up(sample.problem, "x").rsplit("\n", 1)[0])
        q = math_pair(sample, "question", seed=0, image_share=0.25)
        out = parse_question_output(q.completion, EDIT_KEYS[q.kind])
        assert out is not None and edit_in_grammar(q, out.text), q.completion
        kinds[q.kind] += 1
    assert composed > 5 and kinds["text"] > 20 and kinds["image"] > 3, (composed, kinds)


def test_edit_in_grammar_rejects_what_the_toy_world_cannot_execute():
    q = math_pair(_sample(make_row("train", 3, seed=1)), "question", seed=0, image_share=1.0)
    assert q.kind == "image"
    assert not edit_in_grammar(q, "Make it look like a watercolour painting.")
    assert edit_in_grammar(q, "Change the background to cream.")
    text = math_pair(_sample(make_row("train", 3, seed=1)), "question", seed=0, image_share=0.0)
    assert text.kind == "text" and edit_in_grammar(text, "Find 3x.") and not edit_in_grammar(text, "How many stars?")


def test_the_data_module_mixes_roles_and_adds_q_validation(tmp_path):
    dm = SFTReasoningDataModule(
        data_root=str(tmp_path), toy=ToyMathSpec(splits={"train": 64, "val": 4, "ood": 4}, seed=1), batch_size=4
    )
    dm.prepare_data()
    dm.setup("fit")
    roles = [r.task for r in dm.train_set.records]
    assert 0.1 < roles.count("question") / len(roles) < 0.45  # question_share 0.25, fixed by row id
    assert dm.eval_names("val") == ["toy_math_val", "toy_math_ood", "toy_math_val_q"]
    assert {p.role for p in dm.eval_sets["val"]["toy_math_val_q"]} == {"question"}
    assert {p.role for p in dm.eval_sets["val"]["toy_math_ood"]} == {"answer"}
    with pytest.raises(ValueError, match="question_share"):
        SFTReasoningDataModule(data_root=str(tmp_path), question_share=1.5)


def test_sft_module_encodes_a_pair_under_the_grpo_methods_own_prompts():
    from lightning_modules.methods.math_answer import MathAnswer, chat_prompt
    from lightning_modules.methods.question_generator import question_prompt
    from lightning_modules.models.loading import load_policy
    from lightning_modules.sft import SFTModule
    from lightning_modules.sft_examples import pair_prompt

    _, processor = load_policy(str(REPO / "checkpoints/toy-qwen2.5-vl"), dtype="fp32")
    sample = _sample(make_row("train", 1, seed=1))
    a, q = math_pair(sample, "answer"), math_pair(sample, "question")
    assert pair_prompt(processor, a) == MathAnswer().prompt(processor, a, "toy")
    assert pair_prompt(processor, q) == chat_prompt(processor, question_prompt(q.problem, q.answer, q.kind))
    module = SFTModule()
    module.processor = processor
    enc = module.encode([a, q])
    for i, pair in enumerate((a, q)):  # the loss sees exactly the completion and the end of the turn
        labels = enc["labels"][i][enc["labels"][i] != -100]
        assert processor.tokenizer.decode(labels) == pair.completion + "<|im_end|>"
