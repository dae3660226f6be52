"""Math answer grading (core/math_grading.py): extraction, equivalence, format and the answer model's reward, one
literal case per rule, odd inputs included (nothing raises)."""

from __future__ import annotations

import time
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from core.math_grading import (
    accuracy_reward,
    answer_reward,
    answers_match,
    extract_boxed,
    format_ok,
    format_reward,
    normalize_answer,
    parse_choice,
    parse_number,
)

# --- extraction ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so \\boxed{12}.", "12"),
        ("\\boxed{3} then \\boxed{4}", "4"),  # the last one
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),  # nested braces
        ("\\boxed{x^{2}+\\sqrt{y}}", "x^{2}+\\sqrt{y}"),
        ("\\boxed {  7 }", "7"),  # spaces before the brace and inside
        ("\\fbox{8}", "8"),
        ("\\boxed{5} and \\boxed{6", None),  # the last one is never closed (a truncated completion)
        ("\\boxed{}", None),  # empty
        ("no box here: 12", None),
        ("", None),
        (None, None),
        (12, None),
        ([{"role": "assistant", "content": "<think>a</think>\\boxed{9}"}], "9"),  # a conversational completion
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


# --- equivalence -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("12", "12"),
        ("12.0", "12"),  # a decimal of an integer
        ("0.50", ".5"),
        ("1,000", "1000"),  # thousands separator
        ("1{,}000", "1000"),  # LaTeX's thin comma
        ("-3", "- 3"),
        ("50%", "0.5"),  # a percentage equals its value / 100 ...
        ("50\\%", "50"),  # ... and its value
        ("\\frac{1}{2}", "0.5"),
        ("\\dfrac12", "1/2"),
        ("-\\frac{3}{4}", "-0.75"),
        ("$\\frac{6}{8}$", "3/4"),  # reduced
        ("12 cm", "12"),  # a unit
        ("12\\text{ cm}^2", "12"),
        ("45^\\circ", "45"),
        ("45^{\\circ}", "45°"),
        ("3 apples", "3"),
        ("x = 3", "3"),  # an assignment to one variable
        ("$\\text{12}$", "12"),
        ("\\sqrt{2}/2", "\\frac{1}{\\sqrt{2}}"),  # sympy, numerically
        ("\\frac{\\sqrt{3}}{2}", "\\sqrt{3}/2"),
        ("\\sqrt[3]{8}", "2"),
        ("2x+2", "2(x+1)"),  # with a variable: three fixed points
        ("x^2-1", "(x-1)(x+1)"),
        ("2\\pi", "\\pi \\cdot 2"),
        ("(1, 2)", "(1,2)"),
        ("(0.5, 1)", "(\\frac{1}{2}, 1)"),  # element by element
        ("\\{1, 2\\}", "\\{2, 1\\}"),  # a set in any order
        ("A", "A"),
        ("(B)", "B"),  # choice letters
        ("C.", "C"),
        ("D: 12 cm", "D"),
        ("Option E", "E"),
        ("\\text{(A)}", "A"),
        ("Yes", "yes"),  # plain strings, case-folded
    ],
)
def test_answers_that_match(pred, gold):
    assert answers_match(pred, gold)
    assert answers_match(gold, pred)  # symmetric: the vote groups answers with it


@pytest.mark.parametrize(
    ("pred", "gold"),
    [
        ("13", "12"),
        ("0.33", "1/3"),  # rounding is not forgiven
        ("3.14159", "\\pi"),
        ("12", "120"),
        ("1,000", "1"),
        ("1 1/2", "0.5"),  # a mixed number is refused, not read as 1 * 1/2 ...
        ("1 1/2", "5.5"),  # ... nor as 11/2
        ("25%", "0.5"),
        ("B", "A"),
        ("a", "A"),  # a lower-case letter is no choice
        ("12", "A"),
        ("x", "y"),
        ("x+1", "y+1"),  # different variables
        ("(1, 2)", "(2, 1)"),  # a tuple keeps its order
        ("(1, 2)", "[1, 2]"),
        ("(1, 2, 3)", "(1, 2)"),
        ("", "0"),
        ("0", ""),
        (None, "3"),
        ("3", None),
        (True, "1"),  # a bool is no answer
        (["3"], "3"),
        ("1/0", "1"),
        ("\\frac{1}{0}", "0"),
        ("\\boxed{", "1"),
        ("\\frac{", "1"),
        ("\\sqrt", "1"),
        ("}{", "1"),
        ("import os", "1"),
        ("__import__('os')", "1"),
    ],
)
def test_answers_that_do_not_match(pred, gold):
    assert not answers_match(pred, gold)


@pytest.mark.parametrize("bomb", ["9^9^9", "2^(2^(2^64))", "9**9**9**9", "(99^64)^64", "10^{1000}", "9" * 5000])
def test_hostile_expressions_are_refused_quickly(bomb):
    t0 = time.perf_counter()
    assert not answers_match(bomb, "1")
    assert time.perf_counter() - t0 < 1.0  # refused before any evaluation


def test_numbers_choices_and_normalisation():
    assert parse_number("1,234.5") == Fraction(24_690, 20)
    assert parse_number("50%") == Fraction(1, 2)
    assert parse_number("\\frac{3}{4}") == Fraction(3, 4)
    assert parse_number("7 cm") == 7
    assert parse_number("1e999999") is None  # an exponent beyond 3 digits is not read
    assert parse_number("abc") is None
    assert parse_choice("(C)") == "C"
    assert parse_choice("answer: b") is None  # lower case
    assert parse_choice("AB") is None
    assert normalize_answer("$\\left( 1, 2 \\right)$") == "(1,2)"
    assert normalize_answer(None) == ""


# --- format and rewards ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "seed", "strict"),
    [  # seed: EvolvedGRPO@2dffc532 EasyR1/examples/score_function/math.py, compute_score (line 33: spaces around
        # < > / removed) then format_reward (lines 21-24: fullmatch of <think>.*</think>.*\\boxed\{.*\}.*, DOTALL)
        ("<think>count: 3 + 4</think> The answer is \\boxed{7}.", True, True),
        ("  <think>\n</think>\\boxed{7}\n", True, True),  # whitespace around; an empty think part is allowed
        ("<think>3 + 4</think> 7", False, False),  # no box
        ("<think>\\boxed{7}</think> 7", False, False),  # the box only inside the reasoning
        ("\\boxed{7}", False, False),  # no think part
        ("The sum. <think>3 + 4</think>\\boxed{7}", False, False),  # text before the think part
        ("<think>a</think><think>b</think>\\boxed{7}", True, False),  # a second think part: the seed lets it pass
        ("< think > a < /think > \\boxed{7}", True, False),  # spaces inside the tags: the seed removes them
        ("<think>a</think>\\boxed{1}\\boxed{", True, False),  # a later unclosed box: the seed's .* takes it
        ("<think>a</think>\\boxed{7", False, False),  # unclosed box
        ("<think>a", False, False),
        ("", False, False),
        (None, False, False),
    ],
)
def test_format(text, seed, strict):
    assert format_ok(text) is seed
    assert format_ok(text, strict=True) is strict


def test_answer_reward_is_point_nine_accuracy_plus_point_one_format():
    completions = [
        "<think>3 + 4</think>\\boxed{7}",  # right and well formed: 0.9 + 0.1
        "\\boxed{7}",  # right, no think part: 0.9
        "<think>3 + 4</think>\\boxed{8}",  # wrong, well formed: 0.1
        "seven",  # neither: 0
        None,  # not even text: 0
    ]
    assert accuracy_reward(completions, "7") == [1.0, 1.0, 0.0, 0.0, 0.0]
    assert format_reward(completions) == [1.0, 0.0, 1.0, 0.0, 0.0]
    assert answer_reward(completions, ["7"] * 5) == pytest.approx([1.0, 0.9, 0.1, 0.0, 0.0])
    assert answer_reward(completions[:1], "7", format_weight=0.0) == [1.0]
    with pytest.raises(ValueError, match="3 entries for 5 completions"):
        accuracy_reward(completions, ["7"] * 3)
    with pytest.raises(ValueError, match="format_weight"):
        answer_reward(completions, "7", format_weight=2.0)


# --- fuzz: nothing raises on any text --------------------------------------------------------------------------------

_PIECES = ["\\boxed{", "\\frac{", "\\sqrt[", "}", "{", "<think>", "</think>", "^", "**", "9", "x", "%", ",", ".",
           "(", ")", "\\{", "\\}", "A", "$", "\\text{", "cm", "/", "-", " ", "\\pi", "e", "1e5"]  # fmt: skip
_answer_text = st.one_of(st.text(max_size=60), st.lists(st.sampled_from(_PIECES), max_size=25).map("".join))


@settings(max_examples=150, deadline=None)
@given(_answer_text, _answer_text)
def test_grading_never_raises(a, b):
    assert isinstance(answers_match(a, b), bool)
    assert extract_boxed(a) is None or isinstance(extract_boxed(a), str)
    assert isinstance(format_ok(a), bool)
    assert 0.0 <= answer_reward([a], b)[0] <= 1.0
