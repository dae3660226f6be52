"""EvolvedGRPO's method plug-in: the prefix process reward combined with the group-relative outcome, by hand."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
import torch
from method_util import build_test_method  # tests/lightning_modules is on sys.path under pytest
from test_methods import _hp, _rollout  # tests/lightning_modules is on sys.path under pytest

from core import objective

# a hand-made scene (100 x 100): a red square at the top left, a blue circle below it, a blue circle at the right
OBJECTS = [
    {"role": "target", "size": "small", "colour": "blue", "shape": "circle", "box": [10, 60, 30, 80]},
    {"role": "object", "size": "small", "colour": "red", "shape": "square", "box": [10, 10, 30, 30]},
    {"role": "object", "size": "small", "colour": "blue", "shape": "circle", "box": [70, 10, 90, 30]},
]
META = {"objects": OBJECTS, "width": 100, "height": 100, "query": "the small blue circle below the red square"}


@dataclass
class Sample:
    sample_id: str
    query: str
    boxes: list
    meta: dict = field(default_factory=dict)
    size: tuple = (100, 100)
    task: str = "rec"
    image: object = None


def _text(steps, answer):
    body = " ".join(f"Step {k}: x <step>{b}</step>." for k, b in enumerate(steps, 1))
    return f"<think>{body}</think><answer>{answer}</answer>"


ANCHOR, TARGET, MISS = "[10, 10, 30, 30]", "[10, 60, 30, 80]", "[70, 10, 90, 30]"


def test_process_reward_credits_the_correct_prefix_and_ties_break_by_it():
    # two-step question: anchor (red square), then target. G = 4: both steps right + right answer; anchor right, wrong
    # second step and answer; no step right, wrong answer; no steps at all, wrong answer.
    sample = Sample("s0", META["query"], [[10, 60, 30, 80]], {**META, "level": 3})
    texts = [_text([ANCHOR, TARGET], TARGET), _text([ANCHOR, MISS], MISS), _text([MISS, MISS], MISS), _text([], MISS)]
    m = build_test_method("evolved_grpo", _hp(group_size=4, format="think_answer"), {"process_weight": 0.5})
    s = m.score([sample], _rollout(texts, 4))
    assert s.parts["accuracy"].tolist() == [1.0, 0.0, 0.0, 0.0]
    assert s.parts["process"].tolist() == [1.0, 0.5, 0.0, 0.0]  # prefix credit: 2/2, 1/2, 0, 0
    fmt = s.parts["format"]
    assert s.total.tolist() == pytest.approx((s.parts["accuracy"] + fmt + 0.5 * s.parts["process"]).tolist())
    # the three wrong answers tie on outcome; the one that found the anchor gets the larger advantage
    adv = objective.advantages_by_group(s.total, _rollout(texts, 4).group_ids, scale="group", eps=1e-4)
    assert adv[1] > adv[2] == pytest.approx(adv[3])
    logs = m.train_logs(s, _rollout(texts, 4))
    assert logs["train/level/mean"] == 3.0 and logs["train/level/multi_step_frac"] == 1.0
    assert logs["train/level/prefix_credit"] == pytest.approx(0.375)
    assert logs["train/level/outcome_zero_var_frac"] == 0.0


def test_one_step_questions_and_non_toy_samples_get_no_process_term():
    one_step = Sample("s1", "the red square", [[10, 10, 30, 30]], {**META, "query": "the red square"})
    plain = Sample("s2", "the dog", [[0, 0, 5, 5]])
    texts = [_text([ANCHOR], ANCHOR), _text([], MISS)] * 2
    m = build_test_method("evolved_grpo", _hp(format="think_answer"), {"process_weight": 1.0})
    s = m.score([one_step, plain], _rollout(texts, 2))
    assert s.parts["process"].tolist() == [0.0] * 4
    logs = m.train_logs(s, _rollout(texts, 2))
    assert logs["train/level/multi_step_frac"] == 0.0 and logs["train/level/mean"] == 0.0

    # weight 0 is GRPO's total exactly
    g = build_test_method("grpo", _hp(format="think_answer")).score([one_step, plain], _rollout(texts, 2))
    z = build_test_method("evolved_grpo", _hp(format="think_answer"), {"process_weight": 0.0}).score(
        [one_step, plain], _rollout(texts, 2)
    )
    assert z.total.tolist() == g.total.tolist()


def test_guided_sub_problem_questions_use_their_chain_and_count_as_sub():
    guided = "the small blue circle below the red square (step 1: the red square; then the answer)"
    sample = Sample("s3", guided, [[10, 60, 30, 80]], {**META, "level": 2})
    m = build_test_method("evolved_grpo", _hp(format="think_answer"))
    texts = [_text([ANCHOR, TARGET], TARGET), _text([ANCHOR], MISS)]
    s = m.score([sample], _rollout(texts, 2))
    assert s.parts["process"].tolist() == [1.0, 0.5]
    assert m.train_logs(s, _rollout(texts, 2))["train/level/sub_frac"] == 1.0


def test_all_wrong_groups_are_logged_by_the_version_they_are_on():
    """Three samples: the question (group all wrong), its decluttered sub-problem (mixed), the zoomed easier version
    (all wrong): the shares of groups and of all-wrong groups per version, by hand; they sum to all_wrong_frac."""
    one = {**META, "query": "the red square"}
    question = Sample("q", "the red square", [[10, 10, 30, 30]], one)
    sub = Sample("s", "the red square", [[10, 10, 30, 30]], {**one, "edits": [{"kind": "declutter"}]})
    zoomed = {**one, "edits": [{"kind": "declutter"}, {"kind": "zoom"}]}
    easier = Sample("e", "the red square", [[10, 10, 30, 30]], zoomed)
    texts = [_text([], MISS)] * 2 + [_text([], ANCHOR), _text([], MISS)] + [_text([], MISS)] * 2
    m = build_test_method("evolved_grpo", _hp(format="think_answer"))
    logs = m.train_logs(m.score([question, sub, easier], _rollout(texts, 2)), _rollout(texts, 2))
    for name, groups, wrong in [("question", 1, 1), ("sub", 1, 0), ("easier", 1, 1)]:
        assert logs[f"train/level/groups/{name}"] == pytest.approx(groups / 3)
        assert logs[f"train/level/all_wrong/{name}"] == pytest.approx(wrong / 3)
    assert logs["train/level/sub_frac"] == pytest.approx(2 / 3)


def test_bad_method_args_are_clear():
    with pytest.raises(ValueError, match="process_weight must be >= 0"):
        build_test_method("evolved_grpo", _hp(), {"process_weight": -1})
    with pytest.raises(ValueError, match="step_iou"):
        build_test_method("evolved_grpo", _hp(), {"step_iou": 0})


@pytest.mark.parametrize("target", ["toy_steps", "toy_steps_named"])
def test_the_sft_stage_target_earns_the_full_process_reward(target):
    """Round trip: the ``toy_steps`` (and named-steps) SFT target of an evolved multi-step scene, scored by the method,
    gets prefix credit 1 and accuracy 1; a one-step scene's target has no ``<step>``."""
    from datamodules.toy import ToySceneDataset
    from lightning_modules.sft_examples import TARGETS

    toy_steps_target = TARGETS[target]

    ds = ToySceneDataset("train", 200, seed=0, evolve=0.75)
    m = build_test_method("evolved_grpo", _hp(format="syn_grpo"))
    multi = 0
    for i in range(60):
        s = ds[i]
        text = toy_steps_target(s, (112, 112))  # a model input half the scene's size: boxes are rescaled
        ro = _rollout([text, text], 2)
        ro.input_wh = [(112, 112)] * 2
        scores = m.score([s], ro)
        assert scores.parts["accuracy"][0].item() > 0.8 and scores.parts["format"][0].item() == 1.0
        has_steps = bool(scores.extras["multi_step"][0])
        assert ("<step>" in text) == has_steps
        if has_steps:
            multi += 1
            assert scores.parts["process"][0].item() == 1.0, text
            assert (" it <step>" in text) == (target == "toy_steps_named"), text
    assert multi >= 5


def test_padding_repeats_the_last_request_with_a_group_to_drop():
    from lightning_modules.engines.base import RolloutRequest
    from lightning_modules.methods.evolved_grpo import padded

    reqs = [RolloutRequest("a", None, 2, 0), RolloutRequest("b", None, 2, 3)]
    assert padded(reqs, 0) == reqs and padded(reqs, 2) == reqs
    assert [(r.prompt, r.group_id) for r in padded(reqs, 4)] == [("a", 0), ("b", 3), ("b", -1), ("b", -1)]


def test_bad_in_step_args_are_clear():
    with pytest.raises(ValueError, match="reroll must be one of"):
        build_test_method("evolved_grpo", _hp(), {"reroll": "always"})
    with pytest.raises(ValueError, match="sub_levels"):
        build_test_method("evolved_grpo", _hp(), {"reroll": "evolve", "sub_levels": 3})
    with pytest.raises(ValueError, match="correct_iou"):
        build_test_method("evolved_grpo", _hp(), {"correct_iou": 0})


def test_next_version_follows_the_level_rule_on_the_original_scene():
    """In-step evolution's version, by the strategy's rule, edited from the original toy scene: all wrong at the
    question -> its sub-problem version (the steps spelled out, or the decluttered image), exact; all right -> one
    level harder, a new exact question for the same box; a solved sub-problem -> back to the question and its image."""
    from core.toy import query as toy_query
    from datamodules import evolve
    from datamodules.toy import ToySceneDataset

    m = build_test_method("evolved_grpo", _hp(), {"reroll": "evolve"})
    ds = ToySceneDataset("train", 16, seed=0)
    for i in range(16):
        s = ds[i]
        back = m.next_version(s, [False, False], step=0)
        assert back is not None and evolve.version_depth(back.meta, back.query) == 1, s.sample_id
        assert back.boxes == s.boxes and back.meta["level"] == 0 and back.meta["in_step"] == [0, 0, 0, 1]
        assert evolve.query_steps(back.meta, back.query)[-1].box == [int(v) for v in s.boxes[0]]
        up = m.next_version(s, [True, True], step=0)
        if up is None:  # no exact level-1 edit of this scene
            continue
        assert up.meta["level"] == 1 and up.boxes == s.boxes
        if up.query != s.query:  # a text edit: the same image, a question exact on the scene
            assert up.image is s.image and toy_query.is_exact(up.meta, up.query)
        # solved again from the sub-problem: back to the question at level 0, its original image
        again = m.next_version(back, [True, True], step=1)
        assert (
            again.query == s.query and again.meta["level"] == 0 and evolve.version_depth(again.meta, again.query) == 0
        )
        assert np.asarray(again.image).tobytes() == np.asarray(s.image).tobytes()
    plain = Sample("p", "the dog", [[0, 0, 5, 5]])
    assert m.next_version(plain, [False, False], step=0) is None  # no toy scene: nothing to edit in the step


@pytest.mark.parametrize("pad", [False, True], ids=["exact", "padded"])
def test_in_step_evolution_regenerates_converged_groups_on_their_next_version(tiny_model_dir, pad, monkeypatch):
    """A real module and engine (the random tiny model answers no box right, so every group is all wrong): with
    ``reroll: evolve`` each group is generated again on its sub-problem version, whose prompt the rows carry, in the
    batch's order; ``resample`` generates the same versions again; the first try moves the pool. ``padded``: the
    re-generation call padded to more requests (what a CUDA engine with fixed row counts gets), the extra rows
    dropped."""
    from datamodules import evolve
    from datamodules.toy import ToySceneDataset
    from lightning_modules.grpo import GRPOModule
    from lightning_modules.methods import evolved_grpo

    if pad:
        monkeypatch.setattr(evolved_grpo, "reroll_requests", lambda module, b: b + 3)
    batch = [ToySceneDataset("train", 4, seed=0, size=112)[i] for i in range(4)]
    for mode in ("evolve", "resample"):
        module = GRPOModule(
            policy={"model_name_or_path": str(tiny_model_dir), "dtype": "fp32"},
            method={"class_path": "evolved_grpo", "init_args": {"reroll": mode}},
            sampling={"prompt_template": "toy", "group_size": 2, "max_new_tokens": 6},
        )
        module.configure_model()
        ro = module.method.rollout(module.host(), batch)
        assert len(ro.texts) == 8 and ro.group_size == 2 and ro.group_ids.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
        assert ro.info["rerolled"] == [0, 1, 2, 3] and all(a == 0.0 for a in ro.info["first_accuracy"])
        prompts = module.processor.tokenizer.batch_decode(ro.prompt_ids, skip_special_tokens=True)
        for b, (old, new) in enumerate(zip(batch, ro.samples)):
            if mode == "resample":
                assert new is old
            else:
                assert evolve.version_depth(new.meta, new.query) == 1 and new.boxes == old.boxes
            pixels = module.processor.image_processor(images=[new.image], return_tensors="pt")["pixel_values"]
            offsets = ro.patch_offsets()
            for row in (2 * b, 2 * b + 1):  # the rows carry the new version's question and image
                assert new.query.split()[-1] in prompts[row]
                assert torch.allclose(ro.pixel_values[offsets[row] : offsets[row + 1]], pixels)
            if mode == "evolve" and new.query == old.query:  # a decluttered image: not the one the first try saw
                first = module.processor.image_processor(images=[old.image], return_tensors="pt")["pixel_values"]
                assert not torch.allclose(first, pixels)
        # the module's step sees the new versions; the strategy the first try
        scores = module.method.score(ro.samples, ro)
        out = module.method.step_outputs(ro.samples, ro, scores)
        assert out["pool_accuracy"] == [0.0] * 8
        logs = module.method.train_logs(scores, ro)
        assert logs["train/level/reroll/frac"] == 1.0 and logs["train/level/reroll/first_all_wrong"] == 1.0


def test_the_strategy_moves_the_pool_by_the_first_try():
    from callbacks.evolution import build_strategy
    from datamodules.toy import ToySceneDataset
    from lightning_modules.grpo.outputs import StepOutput

    batch = [ToySceneDataset("train", 2, seed=0)[i] for i in range(2)]
    strategy = build_strategy("instruction_evolution", seed=0)
    # the re-rolled rows are mixed, the pool's own version failed: the pool steps back
    outputs = StepOutput(
        completions=[""] * 4, boxes=[[]] * 4, rewards={"accuracy": [1.0, 0.0] * 2}, sample_index=[0, 0, 1, 1],
        group_ids=[0, 0, 1, 1], samples=batch, extras={"pool_accuracy": [0.0] * 4},
    )  # fmt: skip
    strategy.requests(0, batch, outputs)
    assert strategy.stats()["level/sub_frac"] == 1.0


def test_predict_records_score_the_written_steps_of_multi_step_questions():
    """`train.py predict`'s step scores, by hand: the anchor right and the target wrong is half the chain; a guided
    sub-problem question scores its question's chain; a one-step question has none; the set summary averages them."""
    from callbacks.predictions import summarize
    from lightning_modules.evaluation.evaluator import step_scores

    two_step = Sample("a", META["query"], [[10, 60, 30, 80]], META)
    got = step_scores(two_step, _text([ANCHOR, MISS], MISS), (100, 100))
    assert got == {"n": 2, "written": 2, "prefix_credit": 0.5, "step1": True}
    # the model's input at twice the size: its boxes are rescaled to original pixels before they are scored
    doubled = _text(["[20, 20, 60, 60]", "[20, 120, 60, 160]"], "[20, 120, 60, 160]")
    assert step_scores(two_step, doubled, (200, 200))["prefix_credit"] == 1.0
    assert step_scores(two_step, _text([MISS, TARGET], TARGET), (100, 100))["step1"] is False
    assert step_scores(two_step, "<answer>[10, 60, 30, 80]</answer>", (100, 100))["written"] == 0
    guided = Sample("b", META["query"] + " (step 1: the red square; then the answer)", [[10, 60, 30, 80]], META)
    assert step_scores(guided, _text([ANCHOR, TARGET], TARGET), (100, 100))["prefix_credit"] == 1.0
    one_step = Sample("c", "the red square", [[10, 10, 30, 30]], dict(META, query="the red square"))
    assert step_scores(one_step, _text([ANCHOR], ANCHOR), (100, 100)) is None
    assert step_scores(Sample("d", "the cat", [[0, 0, 5, 5]]), _text([ANCHOR], ANCHOR), (100, 100)) is None

    def row(steps):
        return {"task": "rec", "rewards": {"accuracy": 0.0}, "format_ok": True, **({"steps": steps} if steps else {})}

    rows = [row(got), row({"n": 3, "written": 3, "prefix_credit": 0.0, "step1": False}), row(None)]
    summary = summarize(rows)
    assert summary["prefix_credit"] == pytest.approx(0.25) and summary["step1_acc50"] == pytest.approx(0.5)
    assert "prefix_credit" not in summarize([row(None)])
