"""The question generator's reward (core/question_rewards.py): each term with hand-worked numbers, the gate case by
case, and the toy world's stand-in for the CLIP similarity."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from core.coevolution import BRIDGE
from core.question_rewards import (
    QuestionOutput,
    answer_success_rate,
    image_step_probability,
    majority_vote,
    parse_question_output,
    question_reward,
    score_image_edit,
    score_text_edit,
    screen_output,
    text_step_probability,
    toy_similarity,
)

FOLLOW = '{"follow_up_problem": "What is x + 3?"}'
EDIT = '{"edit_instruction": "Add a light paper texture to the background."}'


def boxed(answer: str) -> str:
    return f"<think>...</think>\\boxed{{{answer}}}"


# --- Q's output ------------------------------------------------------------------------------------------------------


def test_parse_question_output_accepts_exactly_one_expected_key():
    assert parse_question_output(FOLLOW) == QuestionOutput("follow_up_problem", "What is x + 3?")
    assert parse_question_output(f"  {EDIT}\n") == QuestionOutput(
        "edit_instruction", "Add a light paper texture to the background."
    )
    assert parse_question_output(FOLLOW, "follow_up_problem") is not None


@pytest.mark.parametrize(
    ("text", "expected_key"),
    [
        ('{"follow_up_problem": "What is x + 3?", "answer": "7"}', None),  # an extra key
        ('{"follow_up_problem": "a", "follow_up_problem": "b"}', None),  # a repeated key is a second key
        ('{"follow_up_problem": "What is x + 3?"', None),  # malformed JSON
        ('```json\n{"follow_up_problem": "What is x + 3?"}\n```', None),  # fenced: not salvaged
        ('Sure! {"follow_up_problem": "What is x + 3?"}', None),  # prose around it
        ('{"follow_up_question": "What is x + 3?"}', None),  # another key
        ('{"follow_up_problem": ""}', None),  # empty
        ('{"follow_up_problem": "   "}', None),
        ('{"follow_up_problem": 3}', None),  # not a string
        ('["follow_up_problem"]', None),  # not an object
        ("{}", None),
        ("", None),
        (None, None),
        (FOLLOW, "edit_instruction"),  # the partition asked for an image edit
        (EDIT, "follow_up_problem"),
        ("[" * 100_000, None),  # deep nesting
    ],
)
def test_parse_question_output_gate(text, expected_key):
    assert parse_question_output(text, expected_key) is None


PROBLEM = "<image>How many red shapes are there?"
"""A row's problem; Q's prompt shows it without ``<image>``."""
LABELLED_COPY = '{"follow_up_problem": "How many red shapes are there? Follow-up question: -"}'
COMPOSED_COPY = json.dumps({"follow_up_problem": f"{PROBLEM[7:]}\n\n{BRIDGE}\nWhat is 2x?"})


@pytest.mark.parametrize(
    ("text", "kind", "gate", "kept"),
    [  # EvolvedGRPO@2dffc532 data_augmentation/question_generator_reward.py, normalize_candidate (lines 72-94) calls
        # augment_dataset.py's normalize_agent_payload: an edit_instruction of < 10 characters (stripped) is refused;
        # a follow-up loses a copy of the problem (and what precedes it), the bridge, a "Follow-up question:" label
        # and leading ":- ", and is refused when nothing is left or it equals the problem
        ('{"edit_instruction": "Blur it."}', "image", "short_instruction", None),  # 8 characters
        ('{"edit_instruction": "  Add noise  "}', "image", "short_instruction", None),  # 9 once stripped
        ('{"edit_instruction": "Add noise."}', "image", "ok", "Add noise."),  # 10
        ('{"follow_up_problem": "How many red shapes are there?"}', "text", "repeats_problem", None),
        ('{"follow_up_problem": "<image>How many red shapes are there?"}', "text", "repeats_problem", None),
        (LABELLED_COPY, "text", "repeats_problem", None),
        (COMPOSED_COPY, "text", "ok", "What is 2x?"),  # the copy of the problem and the bridge are cut
        ('{"follow_up_problem": "Follow-up question: What is x + 1?"}', "text", "ok", "What is x + 1?"),
        ('{"follow_up_problem": "What is x + 1?"}', "text", "ok", "What is x + 1?"),
        ('{"follow_up_problem": "x"}', "image", "malformed", None),  # the other kind's key: the JSON gate first
    ],
)
def test_screen_output_applies_the_seeds_candidate_rules(text, kind, gate, kept):
    out, got = screen_output(text, kind, PROBLEM)
    assert got == gate and (out.text if out else None) == kept


def test_the_seeds_rules_gate_the_scores():
    assert score_image_edit('{"edit_instruction": "Blur it."}', 0.9, [], "3").gate == "short_instruction"
    repeat = '{"follow_up_problem": "How many red shapes are there?"}'
    assert score_text_edit(repeat, ["3"] * 5, [], PROBLEM).gate == "repeats_problem"
    assert score_text_edit(repeat, ["3"] * 5, []).gate == "ok"  # without the problem only the JSON gate applies


# --- the vote --------------------------------------------------------------------------------------------------------


def test_majority_vote_groups_equivalent_answers():
    vote = majority_vote(["7", "7.0", "\\frac{14}{2}", "8", None])
    assert (vote.answer, vote.winning, vote.total, vote.label) == ("7", 3, 5, "7")
    assert vote.counts == [("7", 3), ("8", 1)]
    assert text_step_probability(vote) == pytest.approx(0.6)


def test_majority_vote_needs_two_agreeing():
    assert majority_vote(["1", "2", "3", "4", "5"]).label is None  # five different answers: winner has 1 vote
    assert text_step_probability(majority_vote(["1", "2", "3", "4", "5"])) is None
    two = majority_vote(["4", "4", None, None, None])  # 2 of 5 is enough: p_step = 0.4
    assert (two.label, text_step_probability(two)) == ("4", 0.4)
    none = majority_vote([None] * 5)
    assert (none.answer, none.winning, none.total, none.label) == (None, 0, 5, None)


def test_majority_vote_tie_does_not_depend_on_order():
    assert majority_vote(["9", "9", "3", "3", None]).label == "3"  # 2-2: the smaller normalised text wins
    assert majority_vote(["3", None, "9", "3", "9"]).label == "3"
    with pytest.raises(ValueError, match="smaller than"):
        majority_vote(["1", "1"], total=1)


# --- the terms -------------------------------------------------------------------------------------------------------


def test_image_step_probability_gate():
    assert image_step_probability(0.83) == 0.83
    assert image_step_probability(0.2) == 0.2  # at the threshold: kept
    assert image_step_probability(1.0000001) == 1.0  # round-off above 1 is clipped
    for bad in (0.19, -0.5, float("nan"), float("inf"), None, "high"):
        assert image_step_probability(bad) is None


def test_answer_success_rate():
    completions = [boxed("7"), boxed("7.0"), boxed("8"), "no box, 7", None]
    assert answer_success_rate(completions, "7") == pytest.approx(2 / 5)  # no box counts as wrong
    assert answer_success_rate([], "7") == 0.0
    assert answer_success_rate(completions, None) == 0.0


def test_question_reward_hand_worked():
    # all 5 votes agree and A then always fails: log 1 - log 0.2 + log 5 = log 25
    assert question_reward(1.0, 0.0) == pytest.approx(math.log(25))
    # 2 of 5 agree and A always succeeds: log 0.4 - log 1 + log 5 = log 2
    assert question_reward(0.4, 1.0) == pytest.approx(math.log(2))
    # 3 of 5 agree, A succeeds 2 times in 5: log 0.6 - log 0.4 + log 5 = log 7.5
    assert question_reward(0.6, 0.4) == pytest.approx(math.log(7.5))
    # p_answer below the floor counts as 0.2: log 1 - log 0.2 + log 5
    assert question_reward(1.0, 0.1) == pytest.approx(math.log(25))
    # the lowest valid case, CLIP 0.2 and A always right: log 0.2 + log 5 = 0 (never a round-off negative)
    assert question_reward(0.2, 1.0) == 0.0
    # CLIP 0.1 cannot reach here (gated), but the formula alone would be negative: clamped at 0
    assert question_reward(0.1, 1.0) == 0.0
    for gated in (None, 0.0, -0.1, 1.5, float("nan")):
        assert question_reward(gated, 0.0) == 0.0
    assert question_reward(1.0, float("nan")) == pytest.approx(math.log(5))  # an unreadable p_answer: as if 1


# --- the gate, case by case ------------------------------------------------------------------------------------------


def test_text_edit_score_and_gates():
    hard = [boxed("8")] * 5  # A fails the edited problem every time
    ok = score_text_edit(FOLLOW, ["10", "10", "10", "10", "11"], hard)
    assert (ok.gate, ok.label, ok.p_step, ok.p_answer) == ("ok", "10", 0.8, 0.0)
    assert ok.reward == pytest.approx(math.log(0.8) - math.log(0.2) + math.log(5))  # log 20
    easy = score_text_edit(FOLLOW, ["10"] * 5, [boxed("10")] * 5)
    assert easy.reward == pytest.approx(math.log(5))  # reliable but A always solves it: log 1 - log 1 + log 5

    malformed = score_text_edit('{"follow_up_problem": "x + 3", "answer": 10}', ["10"] * 5, hard)
    assert (malformed.reward, malformed.gate) == (0.0, "malformed")
    wrong_kind = score_text_edit(EDIT, ["10"] * 5, hard)  # the partition asked for a text edit
    assert (wrong_kind.reward, wrong_kind.gate) == (0.0, "malformed")
    no_consensus = score_text_edit(FOLLOW, [None] * 5, hard)
    assert (no_consensus.reward, no_consensus.gate) == (0.0, "no_consensus")
    few = score_text_edit(FOLLOW, ["1", "2", "3", "4", None], hard)
    assert (few.reward, few.gate) == (0.0, "few_votes")
    assert not few.valid and ok.valid


def test_image_edit_score_and_gates():
    ok = score_image_edit(EDIT, 0.9, [boxed("12")] * 2 + [boxed("13")] * 3, "12")
    assert (ok.gate, ok.p_step, ok.p_answer, ok.label) == ("ok", 0.9, 0.4, "12")
    assert ok.reward == pytest.approx(math.log(0.9) - math.log(0.4) + math.log(5))
    low = score_image_edit(EDIT, 0.19, [boxed("13")] * 5, "12")
    assert (low.reward, low.gate) == (0.0, "low_clip")
    malformed = score_image_edit("Add a paper texture.", 0.9, [boxed("13")] * 5, "12")
    assert (malformed.reward, malformed.gate) == (0.0, "malformed")
    wrong_kind = score_image_edit(FOLLOW, 0.9, [boxed("13")] * 5, "12")
    assert wrong_kind.gate == "malformed"


def test_toy_similarity_is_the_object_pixels_iou_by_colour():
    """Source: a red 10 x 10 square and a blue 10 x 10 square on white (200 object pixels)."""
    from core.toy.grammar import COLOURS

    def image(red_at=(10, 10), blue_colour="blue", background=(255, 255, 255), speck=False):
        a = np.full((64, 64, 3), background, np.uint8)
        a[red_at[1] : red_at[1] + 10, red_at[0] : red_at[0] + 10] = COLOURS["red"]
        a[40:50, 40:50] = COLOURS[blue_colour]
        if speck:
            a[0, 0] = (170, 170, 170)  # a grey noise speck: no object colour
        return Image.fromarray(a)

    src = image()
    assert toy_similarity(src, image(background=(253, 246, 227), speck=True)) == 1.0  # appearance only
    # the red square moved 5 px right: it overlaps itself on 50 px; same 150 of a union of 250 = 0.6
    assert toy_similarity(src, image(red_at=(15, 10))) == pytest.approx(150 / 250)
    # the blue square recoloured green: 100 same of a union of 200 = 0.5
    assert toy_similarity(src, image(blue_colour="green")) == pytest.approx(0.5)
    # the red square moved clear of itself and the blue one recoloured: 0 of 300, below the gate's 0.2
    assert toy_similarity(src, image(red_at=(25, 10), blue_colour="green")) == 0.0
    assert image_step_probability(toy_similarity(src, image(red_at=(25, 10), blue_colour="green"))) is None
    assert toy_similarity(src, src.resize((32, 32))) == 0.0  # another size
    blank = Image.new("RGB", (8, 8), "white")
    assert toy_similarity(blank, blank) == 1.0  # nothing to lose


@settings(max_examples=100, deadline=None)
@given(st.one_of(st.text(max_size=80), st.sampled_from([FOLLOW, EDIT]).map(lambda s: s[: len(s) // 2])))
def test_parse_and_scores_never_raise(text):
    assert parse_question_output(text) is None or isinstance(parse_question_output(text), QuestionOutput)
    assert score_text_edit(text, [text] * 5, [text]).reward >= 0.0
    assert score_image_edit(text, 0.5, [text], text).reward >= 0.0
