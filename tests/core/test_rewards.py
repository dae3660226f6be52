"""Tests for core/rewards.py: one literal test per behaviour, the 45 real completions in
shared/data/real_completions.jsonl, property tests that nothing raises on arbitrary text, the OVD reward against
pycocotools, and the diversity smoother's hand-worked EMA sequence."""

from __future__ import annotations

import contextlib
import io
import json
import math
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import core.rewards as rewards_module
from core.rewards import (
    ACCURACY_REWARDS,
    DIVERSITY_REWARD_FORMS,
    MAX_COMPLETION_CHARS,
    DiversitySmoother,
    Tags,
    diversity_reward,
    extract_boxes,
    format_reward,
    ground_truth_diversity,
    iou,
    ovd_reward,
    parse_completion,
    rec_accuracy_reward,
    rescale_box,
)

# 45 verbatim completions of real VLMs from public logs (tests/data/README.md), kept in the repository so the
# parser is always tested on them.
REAL = Path(__file__).resolve().parents[1] / "data" / "real_completions.jsonl"


def real_completions() -> list[dict]:
    return [json.loads(line) for line in REAL.read_text().splitlines() if line.strip()]


def full(answer: str = "[10, 20, 110, 220]", diversity: str = "0.35", description: str = "a snowy street") -> str:
    return (
        f"<think>The query asks for the red car.</think>\n<diversity>{diversity}</diversity>\n"
        f"<description>{description}</description>\n<answer>{answer}</answer>"
    )


GT = [10.0, 20.0, 110.0, 220.0]

# ---------------------------------------------------------------------------------------------------------------------
# Parsing: one literal case per behaviour
# ---------------------------------------------------------------------------------------------------------------------


def test_well_formed_completion():
    p = parse_completion(full())
    assert p.format_ok and p.parts_present == 4
    assert p.think == "The query asks for the red car."
    assert p.diversity == 0.35 and p.description == "a snowy street" and p.boxes == [GT]


def test_correct_box_scores_one():
    assert rec_accuracy_reward([full()], [GT]) == [1.0]


def test_box_in_the_wrong_tag_scores_zero():
    # the box is in the reasoning, the answer has none: nothing to grade
    text = "<think>the box is [10, 20, 110, 220]</think><diversity>0.3</diversity><description>x</description><answer>"
    text += "the red car</answer>"
    assert parse_completion(text).boxes == [] and rec_accuracy_reward([text], [GT]) == [0.0]
    assert format_reward([text]) == [0.0]


def test_float_coordinates():
    assert parse_completion(full("[10.0, 20.5, 110.25, 220.75]")).boxes == [[10.0, 20.5, 110.25, 220.75]]


def test_empty_answer_scores_zero():
    text = full("")
    assert parse_completion(text).boxes == [] and not parse_completion(text).format_ok
    assert rec_accuracy_reward([text], [GT]) == [0.0] and format_reward([text]) == [0.0]


def test_vlm_r1_bbox_2d_json():
    text = full('{"bbox_2d": [10, 20, 110, 220], "label": "red car"}')
    assert parse_completion(text).boxes == [GT] and parse_completion(text).format_ok
    text = full('[{"bbox_2d": [10, 20, 110, 220], "label": "a"}, {"bbox_2d": [1, 2, 3, 4], "label": "b"}]')
    assert parse_completion(text).boxes == [GT, [1.0, 2.0, 3.0, 4.0]]
    assert extract_boxes('{"bbox_2d": "[10, 20, 110, 220]"}') == [GT]  # stringified list
    assert extract_boxes('{"bounding_box": [10, 20, 110, 220]}') == [GT]


def test_fenced_json():
    fenced = '```json\n[\n\t{"bbox_2d": [10, 20, 110, 220], "label": "red car"}\n]\n```'
    assert parse_completion(full(fenced)).boxes == [GT]
    # duplicated and stray fences
    assert extract_boxes(fenced + "\n" + fenced) == [GT, GT]
    assert extract_boxes(fenced + "json") == [GT]


def test_multiple_boxes_ovd():
    assert parse_completion(full("[1, 2, 3, 4], [5, 6, 7, 8]")).boxes == [[1, 2, 3, 4], [5, 6, 7, 8]]


def test_broken_json_is_salvaged():
    # VLM-R1 checkpoint-300 style: a stray quote opens a string that never closes
    text = full('["{"bbox_2d": [10, 20, 110, 220], "label": "left apple."}]')
    assert parse_completion(text).boxes == [GT]


def test_points_and_parenthesised_tuples_are_not_boxes():
    assert extract_boxes('[{"point_2d": ["38", "314"]}, {"bbox_2d": [1835, 760]}]') == []
    assert extract_boxes("(115,175,306,247)") == []
    assert extract_boxes("[nan, 1, 2, 3] [1e999, 1, 2, 3]") == []


def test_untagged_text_reads_with_extract_boxes_only():
    qwen_demo = '```json\n[\n\t{"bbox_2d": [74, 58, 526, 619], "label": "person"}\n]\n```'
    assert extract_boxes(qwen_demo) == [[74.0, 58.0, 526.0, 619.0]]
    assert parse_completion(qwen_demo).boxes == []  # no answer tag: not an answer


def test_truncated_answer_still_yields_its_box_but_not_the_format():
    text = full()[: -len("</answer>")]
    p = parse_completion(text)
    assert p.boxes == [GT] and not p.format_ok and p.parts_present == 3


def test_diversity_parsing():
    assert parse_completion(full(diversity=" 0.8 ")).diversity == 0.8
    assert parse_completion(full(diversity="1.7")).diversity == 1.0  # clipped
    assert parse_completion(full(diversity="-0.2")).diversity == 0.0
    for bad in ("high", "", "nan", "inf", "0.3 or 0.4"):
        p = parse_completion(full(diversity=bad))
        assert p.diversity is None and not p.format_ok


def test_format_strictness():
    assert format_reward([full()]) == [1.0]
    assert format_reward(["  \n" + full() + "\n "]) == [1.0]  # surrounding whitespace is fine
    assert format_reward(["Sure! " + full()]) == [0.0]  # text outside the parts
    swapped = "<think>t</think><description>d</description><diversity>0.3</diversity><answer>[1,2,3,4]</answer>"
    assert format_reward([swapped]) == [0.0]  # out of order
    nested = full().replace("</think>", "<answer>[1,2,3,4]</answer></think>")
    assert format_reward([nested]) == [0.0]  # a tag inside another part
    assert format_reward([full(description="   ")]) == [0.0]  # empty description
    # partial credit: the fraction of the four parts present and valid
    no_desc = "<think>t</think><diversity>0.3</diversity><answer>[1,2,3,4]</answer>"
    assert format_reward([no_desc]) == [0.0]
    assert format_reward([no_desc], partial=True) == [0.75]
    assert format_reward([full()], partial=True) == [1.0]
    # the caller's parses give the same verdicts (the GRPO reward step parses once for format and diversity)
    texts = [full(), "Sure! " + full(), swapped, no_desc]
    parsed = [parse_completion(t) for t in texts]
    for partial in (False, True):
        assert format_reward(texts, parsed=parsed, partial=partial) == format_reward(texts, partial=partial)
    with pytest.raises(ValueError, match="2 parsed completions for 4"):
        format_reward(texts, parsed=parsed[:2])


def test_custom_tags_and_conversational_completions():
    tags = Tags(think="reasoning", answer="box")
    text = "<reasoning>r</reasoning><diversity>0.5</diversity><description>d</description><box>[1,2,3,4]</box>"
    assert parse_completion(text, tags).format_ok and not parse_completion(text).format_ok
    assert format_reward([[{"role": "assistant", "content": full()}]]) == [1.0]
    with pytest.raises(ValueError, match="--model.tags"):
        Tags(answer="a b")
    with pytest.raises(ValueError, match="--model.tags"):
        Tags(answer="think")


# ---------------------------------------------------------------------------------------------------------------------
# Geometry
# ---------------------------------------------------------------------------------------------------------------------


def test_iou_literals():
    assert iou(GT, GT) == 1.0
    assert iou([0, 0, 10, 10], [5, 0, 15, 10]) == pytest.approx(50 / 150)  # half overlap: 50 / (100 + 100 - 50)
    assert iou([0, 0, 10, 10], [10, 0, 20, 10]) == 0.0  # touching edges
    assert iou([0, 0, 10, 10], [2, 2, 4, 4]) == pytest.approx(4 / 100)  # contained
    assert iou([10, 10, 0, 0], [0, 0, 10, 10]) == 0.0  # reversed
    assert iou([0, 0, 0, 10], [0, 0, 10, 10]) == 0.0  # empty
    assert iou([0, 0, math.nan, 10], [0, 0, 10, 10]) == 0.0
    assert iou([0, 0, math.inf, 10], [0, 0, 10, 10]) == 0.0
    assert iou([0, 0, 10], [0, 0, 10, 10]) == 0.0 and iou(None, GT) == 0.0


def test_rescaling_with_the_qwen_convention():
    # A 1000 x 500 photo is fed to Qwen2.5-VL resized to 500 x 250; the model answers in resized pixels.
    assert rescale_box([50, 50, 100, 100], (500, 250), (1000, 500)) == [100.0, 100.0, 200.0, 200.0]
    # Non-uniform: x by 640 / 644, y by 480 / 476 (COCO 640 x 480 resized to multiples of 28).
    assert rescale_box([644, 476, 644, 476], (644, 476), (640, 480)) == pytest.approx([640, 480, 640, 480])
    text = full("[50, 50, 100, 100]")
    gt = [100, 100, 200, 200]
    assert rec_accuracy_reward([text], [gt], input_wh=(500, 250), orig_wh=(1000, 500)) == [1.0]
    assert rec_accuracy_reward([text], [gt]) == [0.0]  # compared as written, the boxes only touch at a corner
    with pytest.raises(ValueError):
        rescale_box([1, 2, 3, 4], (0, 250), (1000, 500))


def test_reward_arguments_broadcast_and_check_lengths():
    texts = [full(), full("[0, 0, 1, 1]")]
    assert rec_accuracy_reward(texts, GT) == [1.0, 0.0]  # one GT box for all
    assert rec_accuracy_reward(texts, [GT, None]) == [1.0, 0.0]  # unknown GT scores 0
    assert rec_accuracy_reward(texts, [GT, GT], input_wh=[(1, 1), (1, 1)], orig_wh=(1, 1)) == [1.0, 0.0]
    with pytest.raises(ValueError):
        rec_accuracy_reward(texts, [GT, GT, GT])
    assert ACCURACY_REWARDS["iou"] is rec_accuracy_reward and ACCURACY_REWARDS["ovd"] is ovd_reward


# ---------------------------------------------------------------------------------------------------------------------
# Real completions
# ---------------------------------------------------------------------------------------------------------------------

# index -> (boxes parse_completion must find (None: don't check), IoU bound with gt_box: (">=", x) or ("==", x))
REAL_EXPECTED = {
    0: ([[352.14, 33.94, 639.59, 224.86]], ("==", 1.0)),  # float list equal to GT: accuracy 1.0
    7: ([[0.17, 0.39, 0.5, 0.76], [0.55, 0.4, 0.75, 0.82]], ("==", 0.0)),  # normalised floats vs 0-1000 GT
    8: ([], ("==", 0.0)),  # truncated think, no answer
    9: ([], ("==", 0.0)),  # box only inside <think>
    12: ([[0.14, 0.37, 0.36, 0.54]], None),  # '<0.34, ...]' is not a box
    13: ([], ("==", 0.0)),  # parenthesised tuple
    15: ([], ("==", 0.0)),  # '[<(385,288),(976,693)]'
    16: ([], ("==", 0.0)),  # box inside think, stray </answer>
    17: ([], ("==", 0.0)),
    18: ([[289.0, 562.0, 409.0, 927.0]], None),  # the answer's box, not the think's tuple
    20: ([[14.0, 135.0, 136.0, 470.0]], (">=", 0.5)),  # logged correct=1
    22: ([[0.0, 1.0, 153.0, 78.0]] * 2, (">=", 0.5)),  # same box twice; logged correct=1
    23: ([[84.0, 250.0, 296.0, 371.0], [253.0, 250.0, 543.0, 382.0]], (">=", 0.5)),  # FIRST box is the right one
    24: (None, None),
    26: ([], ("==", 0.0)),  # a point under 'location'
    29: ([], ("==", 0.0)),  # refusal
    30: ([], ("==", 0.0)),  # prose with parenthesised tuples, no tags
    32: ([], ("==", 0.0)),  # 2-number bbox_2d
    36: ([[289.0, 65.0, 477.0, 331.0]], (">=", 0.5)),  # unclosed answer after a bare duplicate
    38: ([], ("==", 0.0)),  # well-formed refusal
    41: ([], ("==", 0.0)),  # empty bounding_box, no answer tag
    43: ([], ("==", 0.0)),  # truncated prose
    44: ([[15.0, 136.0, 134.0, 470.0]], (">=", 0.5)),  # stray ```json before </answer>; logged correct=1
}

# untagged outputs read by extract_boxes: index -> number of boxes (first box when given)
REAL_EXTRACT = {
    1: (4, [341.0, 258.0, 397.0, 360.0]),  # Qwen demo, tab-indented fence, extra keys
    2: (1, [74.0, 58.0, 526.0, 619.0]),
    3: (12, [19.0, 3.0, 84.0, 125.0]),  # JSON followed by prose after the fence
    5: (0, None),  # points only
    19: (1, [14.0, 135.0, 136.0, 470.0]),
    24: (4, [734.0, 536.0, 801.0, 692.0]),  # four concatenated objects
    31: (3, [56.0, 387.0, 249.0, 618.0]),
    37: (2, [543.0, 28.0, 616.0, 537.0]),  # bbox_2d plus a stringified list under 'answer'
    40: (1, [450.0, 102.0, 644.0, 307.0]),  # key 'bounding_box'
    41: (0, None),  # "bounding_box": []
}


def test_real_completions_parse_and_score_in_range():
    rows = real_completions()
    assert len(rows) == 45
    texts = [r["text"] for r in rows]
    for text in texts:
        p = parse_completion(text)
        assert not p.format_ok  # none of them has the diversity and description parts
        assert all(len(b) == 4 and all(math.isfinite(v) for v in b) for b in p.boxes)
    for fn in (format_reward, lambda c: format_reward(c, partial=True)):
        assert all(0.0 <= r <= 1.0 for r in fn(texts))
    with_gt = [r for r in rows if r["gt_box"]]
    accs = rec_accuracy_reward([r["text"] for r in with_gt], [r["gt_box"] for r in with_gt])
    assert all(0.0 <= a <= 1.0 for a in accs)
    # the bbox_2d count of the broken text-spotting JSON (trailing comma) is salvaged box by box
    assert len(extract_boxes(rows[4]["text"])) == rows[4]["text"].count('"bbox_2d"')


@pytest.mark.parametrize("index", sorted(REAL_EXPECTED))
def test_real_completion_expectations(index):
    row = real_completions()[index]
    boxes, bound = REAL_EXPECTED[index]
    p = parse_completion(row["text"])
    if boxes is not None:
        assert p.boxes == boxes, row["note"]
    if bound is not None:
        (acc,) = rec_accuracy_reward([row["text"]], [row["gt_box"]])
        op, value = bound
        assert acc == value if op == "==" else acc >= value, (acc, row["note"])


@pytest.mark.parametrize("index", sorted(REAL_EXTRACT))
def test_real_completion_extract_boxes(index):
    row = real_completions()[index]
    count, first = REAL_EXTRACT[index]
    boxes = extract_boxes(row["text"])
    assert len(boxes) == count, row["note"]
    if first is not None:
        assert boxes[0] == first


# ---------------------------------------------------------------------------------------------------------------------
# Property tests: nothing raises, everything in range
# ---------------------------------------------------------------------------------------------------------------------

FRAGMENTS = [
    "<think>", "</think>", "<diversity>", "</diversity>", "<description>", "</description>", "<answer>", "</answer>",
    "[", "]", "{", "}", ",", " ", "\n", "\t", '"', "```json", "```", '"bbox_2d":', "0.5", "1", "-3", "1e309", "nan",
    "12.", ".5", "[1, 2, 3, 4]", '{"bbox_2d": [1, 2, 30, 40]}', "(1,2),(3,4)", "<", ">", "/", "\\", "null", "true",
]  # fmt: skip
completion_text = st.one_of(
    st.text(max_size=200),
    st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(max_size=4)), max_size=40).map("".join),
)
fast = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@fast
@given(completion_text)
def test_parse_never_raises(text):
    p = parse_completion(text)
    assert p.diversity is None or 0.0 <= p.diversity <= 1.0
    assert p.description is None or (p.description and p.description == p.description.strip())
    assert all(len(b) == 4 and all(math.isfinite(v) for v in b) for b in p.boxes)
    assert 0 <= p.parts_present <= 4 and (not p.format_ok or p.parts_present == 4)
    assert all(len(b) == 4 for b in extract_boxes(text))


@fast
@given(st.lists(completion_text, min_size=1, max_size=4), st.lists(st.floats(-10, 1000), min_size=4, max_size=4))
def test_rec_and_format_rewards_in_range(texts, gt):
    for r in rec_accuracy_reward(texts, gt, input_wh=(500, 250), orig_wh=(1000, 500)):
        assert 0.0 <= r <= 1.0
    for partial in (False, True):
        for r in format_reward(texts, partial=partial):
            assert 0.0 <= r <= 1.0


@settings(max_examples=30, deadline=None)
@given(st.lists(completion_text, min_size=1, max_size=3))
def test_ovd_reward_in_range(texts):
    for r in ovd_reward(texts, [[1, 2, 30, 40], [50, 50, 90, 95]]):
        assert 0.0 <= r <= 1.0


@fast
@given(
    st.lists(st.one_of(st.none(), st.floats(allow_nan=True, allow_infinity=True)), min_size=1, max_size=8), st.data()
)
def test_diversity_reward_in_range(pred, data):
    target = data.draw(st.lists(st.floats(-1, 2), min_size=len(pred), max_size=len(pred)))
    for form in DIVERSITY_REWARD_FORMS:
        for r in diversity_reward(pred, target, form=form):
            assert 0.0 <= r <= 1.0


# ---------------------------------------------------------------------------------------------------------------------
# Pathological completions: any depth, any size, any type (the rewards never raise; their speed on runaway completions
# is a benchmark figure, bench/reward_speed.py, not a timed test)
# ---------------------------------------------------------------------------------------------------------------------


def nest(leaf, depth: int, wraps=(lambda x: [x],)):
    """``leaf`` inside ``depth`` containers, built in a loop (cycling through ``wraps``)."""
    for i in range(depth):
        leaf = wraps[i % len(wraps)](leaf)
    return leaf


def assert_rewards_hold(completions: list) -> None:
    """Every reader and reward takes ``completions`` without raising: one value each, a float in [0, 1]."""
    n = len(completions)
    for c in completions:
        p = parse_completion(c)
        assert p.diversity is None or 0.0 <= p.diversity <= 1.0
        assert all(len(b) == 4 and all(math.isfinite(v) for v in b) for b in p.boxes)
        assert 0 <= p.parts_present <= 4 and (not p.format_ok or p.parts_present == 4)
        assert all(len(b) == 4 and all(math.isfinite(v) for v in b) for b in extract_boxes(c))
    rewards = [
        format_reward(completions),
        format_reward(completions, partial=True),
        format_reward(completions, format="think_answer"),
        rec_accuracy_reward(completions, GT),
        ovd_reward(completions, [GT, [300, 300, 340, 380]]),
    ]
    for values in rewards:
        assert len(values) == n
        assert all(isinstance(v, float) and 0.0 <= v <= 1.0 for v in values)


MESSAGE = {"role": "assistant", "content": full()}
cyclic: list = [MESSAGE]
cyclic.append(cyclic)
DEEP = {
    "list-5k": nest(MESSAGE, 5_000),
    "tuple-50k": nest(full(), 50_000, (lambda x: (x,),)),
    "mixed-50k": nest([MESSAGE], 50_000, (lambda x: [x], lambda x: (x, ""), lambda x: ["", x])),
    "content-dict-5k": nest(full(), 5_000, (lambda x: {"role": "assistant", "content": x},)),
    "cyclic": cyclic,
    "json-5k-with-box": full(answer="[" * 5_000 + "10, 20, 110, 220" + "]" * 5_000),
    "json-100k": full(answer="[" * 100_000 + "]" * 100_000),
    "json-100k-unclosed": "<answer>" + "[" * 100_000,
    "json-objects-100k": full(answer='{"bbox_2d": ' * 100_000 + "1" + "}" * 100_000),
    "fenced-json-50k": full(answer="```json\n" + "[{" * 50_000),
}


@pytest.mark.parametrize("name", list(DEEP))
def test_deep_nesting_never_raises(name):
    """5,000 to 100,000 levels, as Python containers (read without recursion) or as JSON text (json.loads gives up;
    the salvage reads the text)."""
    completion = DEEP[name]
    assert_rewards_hold([completion, full()])
    if name in ("list-5k", "tuple-50k", "mixed-50k", "json-5k-with-box"):  # the box inside is still read
        assert parse_completion(completion).boxes == [GT]
        assert rec_accuracy_reward([completion], GT) == [1.0]
    if name == "cyclic":  # a list inside itself is not read again
        assert parse_completion(completion).format_ok


def test_conversational_nesting_reads_in_order():
    nested = [[{"role": "assistant", "content": "<think>t</think>"}], ("<diversity>0.5</diversity>", [{"content": 3}])]
    nested += [{"content": "<description>d</description>"}, [[["<answer>[10, 20, 110, 220]</answer>"]]], None, b"x"]
    assert parse_completion(nested) == parse_completion(
        "<think>t</think><diversity>0.5</diversity><description>d</description><answer>[10, 20, 110, 220]</answer>"
    )


@pytest.fixture(scope="module")
def huge() -> dict[str, str]:
    mb = 1 << 20
    return {
        "digits": full(answer="[" + "1" * (10 * mb)),
        "spaces": full().replace("\n", " " * (MAX_COMPLETION_CHARS - 1_000), 1),  # within what is read
        "spaces-beyond": full().replace("\n", " " * (10 * mb), 1),
        "diversity-digits": full(diversity="0." + "5" * (2 * mb) + "x"),
        "brackets": full(answer="[ 1, " * (mb // 16)),
        "boxes": full(answer=", ".join(["[1, 2, 3, 4]"] * 5_000)),
        "tags": "<think>" * (mb // 2),
    }


def test_huge_completions_never_raise(huge):
    assert_rewards_hold(list(huge.values()))
    assert parse_completion(huge["spaces"]).format_ok
    assert not parse_completion(huge["spaces-beyond"]).format_ok  # its answer lies past the first MiB: not read
    assert len(parse_completion(huge["boxes"]).boxes) == 5_000


def test_a_10_mb_completion_is_scored_on_its_first_mib(monkeypatch):
    """A runaway completion of 10 MB and 1M boxes (plain string, or as a conversational message) is read up to
    ``MAX_COMPLETION_CHARS`` before any parsing: it scores as its first MiB does, and the parser never sees more (it
    took 5-60 s to parse whole; the first MiB, 75k boxes, ~0.5 s on a loaded 2-core machine)."""
    box = "[1, 2, 3, 4],"
    runaway = full(answer=box * (10 * 2**20 // len(box)))
    assert len(runaway) > 10 * 2**20 and runaway.count(box) > 800_000
    first_mib = runaway[:MAX_COMPLETION_CHARS]
    gt = [[1, 2, 3, 4], [10, 20, 110, 220]]
    expected = ovd_reward([first_mib], gt) + rec_accuracy_reward([first_mib], [1, 2, 3, 4])
    assert 0.0 < expected[0] < 1e-3 and expected[1] == 1.0  # s_ovd = 2 / ~75k boxes read

    parsed_lengths = []
    real_extract = rewards_module.extract_boxes
    monkeypatch.setattr(rewards_module, "extract_boxes", lambda t: parsed_lengths.append(len(t)) or real_extract(t))
    for completion in (runaway, [{"role": "assistant", "content": runaway}]):
        start = time.perf_counter()
        scored = ovd_reward([completion], gt) + rec_accuracy_reward([completion], [1, 2, 3, 4])
        assert time.perf_counter() - start < 5.0  # generous for a loaded machine; whole, it took 5-60 s
        assert scored == expected
    assert parsed_lengths and max(parsed_lengths) < MAX_COMPLETION_CHARS


ODD = [None, 0, -1, 2**70, 1.5, math.nan, math.inf, True, b"<answer>[1, 2, 3, 4]</answer>", bytearray(b"[1,2,3,4]"),
       object(), torch.zeros(4), torch.tensor([10.0, 20.0, 110.0, 220.0]), {"content": None}, {"content": [full()]},
       {1, 2}, range(4), Tags(), (x for x in [full()]), "\x00\ud800\U0010ffff"]  # fmt: skip


def test_odd_types_never_raise():
    assert_rewards_hold(ODD)
    assert_rewards_hold([ODD])  # the whole list as one conversational completion


odd_values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.binary(max_size=8),
    st.sampled_from([object(), torch.zeros(2), math.nan, range(2)]),
)
messages = st.one_of(
    completion_text,
    odd_values,
    st.fixed_dictionaries({"role": st.just("assistant"), "content": st.one_of(completion_text, odd_values)}),
)
nested_completions = st.recursive(
    messages,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3),
        st.lists(inner, max_size=3).map(tuple),
        st.fixed_dictionaries({"content": inner}),
    ),
    max_leaves=12,
)


WRAPS = {
    "list": (lambda x: [x],),
    "tuple": (lambda x: (x,),),
    "content": (lambda x: {"role": "assistant", "content": x},),
    "mixed": (lambda x: [x, "<answer>"], lambda x: ("[1, 2", x), lambda x: [{"content": "]"}, x]),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(nested_completions, min_size=1, max_size=3),
    st.sampled_from(sorted(WRAPS)),
    st.one_of(st.integers(0, 50), st.integers(0, 20_000)),
)
def test_nested_odd_completions_never_raise(completions, wrap, depth):
    completions[0] = nest(completions[0], depth, WRAPS[wrap])
    assert_rewards_hold(completions)


# ---------------------------------------------------------------------------------------------------------------------
# OVD reward
# ---------------------------------------------------------------------------------------------------------------------

OVD_GT = [[10.0, 10.0, 50.0, 50.0], [100.0, 100.0, 160.0, 140.0]]


def test_ovd_perfect_and_duplicated_predictions():
    perfect = full("[10, 10, 50, 50], [100, 100, 160, 140]")
    assert ovd_reward([perfect], [OVD_GT]) == [1.0]
    # Every box written twice: the mAP stays 1 (each GT matched by the higher-scored copy, the copies are false
    # positives ranked after every true positive) but s_ovd = N_gt / N_pred = 2 / 4 halves the reward.
    doubled = full("[10, 10, 50, 50], [100, 100, 160, 140], [10, 10, 50, 50], [100, 100, 160, 140]")
    assert ovd_reward([doubled], [OVD_GT]) == [0.5]
    # Fewer predictions than GT: s_ovd is capped at 1, the mAP pays for the miss (recall 1/2 -> AP ~ 0.5).
    assert ovd_reward([full("[10, 10, 50, 50]")], [OVD_GT])[0] == pytest.approx(0.5, abs=0.01)
    assert ovd_reward([full("no boxes")], [OVD_GT]) == [0.0]
    assert ovd_reward([perfect], [[]]) == [0.0]  # no GT: nothing to detect, never negative


def test_ovd_rescales_to_original_pixels():
    half = full("[5, 5, 25, 25], [50, 50, 80, 70]")
    assert ovd_reward([half], OVD_GT, input_wh=(320, 240), orig_wh=(640, 480)) == [1.0]


def _pycocotools_map(preds, gts):
    """COCO mAP@[.5:.95] of one image, one category, scores by order, computed by pycocotools itself."""
    coco_mod = pytest.importorskip("pycocotools.coco")
    eval_mod = pytest.importorskip("pycocotools.cocoeval")

    def xywh(b):
        return [b[0], b[1], b[2] - b[0], b[3] - b[1]]

    gt = coco_mod.COCO()
    gt.dataset = {
        "images": [{"id": 1, "width": 1000, "height": 1000}],
        "categories": [{"id": 1, "name": "thing"}],
        "annotations": [
            {
                "id": i + 1,
                "image_id": 1,
                "category_id": 1,
                "bbox": xywh(b),
                "area": xywh(b)[2] * xywh(b)[3],
                "iscrowd": 0,
            }
            for i, b in enumerate(gts)
        ],
    }
    with contextlib.redirect_stdout(io.StringIO()):
        gt.createIndex()
        dt = gt.loadRes(
            [
                {"image_id": 1, "category_id": 1, "bbox": xywh(b), "score": (len(preds) - i) / len(preds)}
                for i, b in enumerate(preds)
            ]
        )
        ev = eval_mod.COCOeval(gt, dt, iouType="bbox")
        ev.evaluate()
        ev.accumulate()
        ev.summarize()
    return float(ev.stats[0])


def test_ovd_reward_matches_pycocotools():
    # Three predictions for two objects: a good match (IoU ~0.82), a loose one (IoU ~0.6) and a false positive.
    preds = [[12.0, 10.0, 52.0, 48.0], [100.0, 100.0, 150.0, 125.0], [300.0, 300.0, 340.0, 340.0]]
    text = full(", ".join(json.dumps(b) for b in preds))
    expected = min(len(OVD_GT) / len(preds), 1.0) * _pycocotools_map(preds, OVD_GT)
    assert 0.0 < expected < 2 / 3
    assert ovd_reward([text], [OVD_GT])[0] == pytest.approx(expected, abs=1e-4)


# ---------------------------------------------------------------------------------------------------------------------
# Diversity
# ---------------------------------------------------------------------------------------------------------------------


def test_ground_truth_diversity_hand_worked():
    acc = [1, 0, 1, 0, 1, 0] + [1] * 6 + [1, 0, 0, 0, 0, 0]
    # half right / half wrong: population variance 1/4, the maximum -> 1; all right -> 0; one of six right:
    # mean 1/6, variance 1/6 * 5/6 = 5/36 -> / (1/4) = 5/9.
    assert torch.allclose(ground_truth_diversity(acc, 6), torch.tensor([1.0, 0.0, 5 / 9]))
    # continuous IoU rewards: [0.8, 0.6] -> variance 0.01 -> 0.04
    assert torch.allclose(ground_truth_diversity(torch.tensor([0.8, 0.6]), 2), torch.tensor([0.04]))
    with pytest.raises(ValueError, match="--model.sampling.group_size"):
        ground_truth_diversity([1.0, 0.0, 1.0], 2)


def test_diversity_reward_forms_hand_worked():
    # prediction 0.3, target 0.5: linear 1 - 0.2; squared 1 - 0.04; gaussian exp(-0.04 / (2 * 0.01)) = e^-2
    assert diversity_reward([0.3], [0.5]) == [pytest.approx(0.8)]
    assert diversity_reward([0.3], [0.5], form="squared") == [pytest.approx(0.96)]
    assert diversity_reward([0.3], [0.5], form="gaussian") == [pytest.approx(math.exp(-2))]
    assert diversity_reward([None, 0.5], torch.tensor([0.5, 0.5])) == [0.0, 1.0]  # unreadable prediction earns 0
    with pytest.raises(ValueError, match="--model.method.init_args.diversity_reward_form"):
        diversity_reward([0.3], [0.5], form="cosine")


def test_smoother_hand_worked_sequence():
    s = DiversitySmoother(beta=0.7)
    # step 1: batch_avg 0.4 initialises global_avg = 0.4, ratio 1: V~ = V
    assert torch.allclose(s(torch.tensor([0.2, 0.6])), torch.tensor([0.2, 0.6]))
    assert s.global_avg == pytest.approx(0.4) and s.steps == 1
    # step 2 (collapse): batch_avg 0.1; global = 0.7 * 0.4 + 0.3 * 0.1 = 0.31; ratio 3.1 scales 0.1 up to 0.31
    assert torch.allclose(s(torch.tensor([0.1, 0.1])), torch.tensor([0.31, 0.31]))
    # step 3: batch_avg 0.25; global = 0.7 * 0.31 + 0.3 * 0.25 = 0.292; ratio 1.168: [0, 0.584]
    assert torch.allclose(s(torch.tensor([0.0, 0.5])), torch.tensor([0.0, 0.584]))
    # step 4 (a diverse batch): batch_avg 0.9; global = 0.7 * 0.292 + 0.3 * 0.9 = 0.4744; scaled down to 0.4744
    assert torch.allclose(s(torch.tensor([0.9, 0.9])), torch.tensor([0.4744, 0.4744]))
    assert s.batch_avg == pytest.approx(0.9) and s.global_avg == pytest.approx(0.4744)
    # step 5: batch_avg 0.225; global = 0.7 * 0.4744 + 0.3 * 0.225 = 0.39958; 0.9 * 1.7759 = 1.598 is clipped to 1
    out = s(torch.tensor([0.9, 0.0, 0.0, 0.0]))
    assert torch.allclose(out, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_smoother_zero_batch_guard():
    s = DiversitySmoother(beta=0.7)
    # a first batch of zero-variance groups carries no scale: returned as is, global_avg not initialised
    assert torch.equal(s(torch.zeros(3)), torch.zeros(3))
    assert s.global_avg is None and s.batch_avg == 0.0 and s.skipped == 1 and s.steps == 1
    s(torch.tensor([0.4, 0.4]))  # initialises to 0.4
    assert torch.equal(s(torch.zeros(2)), torch.zeros(2))
    assert s.global_avg == pytest.approx(0.4) and s.skipped == 2  # the EMA was left alone
    assert torch.isfinite(s(torch.tensor([0.0, 0.2]))).all()


def test_smoother_state_dict_round_trip():
    a = DiversitySmoother(beta=0.7)
    a(torch.tensor([0.2, 0.6]))
    a(torch.tensor([0.1, 0.1]))
    state = json.loads(json.dumps(a.state_dict()))  # plain numbers only
    b = DiversitySmoother(beta=0.7)
    b.load_state_dict(state)
    v = torch.tensor([0.3, 0.5])
    assert torch.equal(a(v), b(v)) and a.state_dict() == b.state_dict()


def test_smoother_validates_beta():
    for bad in (1.0, -0.1, 1.5):
        with pytest.raises(ValueError, match="--model.method.init_args.diversity_beta"):
            DiversitySmoother(beta=bad)
    DiversitySmoother(beta=0.0)  # no inertia: global_avg == batch_avg, V~ = V


def test_smoother_averages_over_ranks(monkeypatch):
    # Pretend another rank holds V = [0.9, 0.9, 0.9]: the global batch average is (0.1 + 0.3 + 2.7) / 5 = 0.62.
    def fake_all_reduce(tensor, op=None, group=None):
        tensor += torch.tensor([2.7, 3.0], dtype=tensor.dtype)

    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "all_reduce", fake_all_reduce)
    s = DiversitySmoother(beta=0.7)
    s(torch.tensor([0.1, 0.3]))
    assert s.batch_avg == pytest.approx(0.62) and s.global_avg == pytest.approx(0.62)
    # step 2: this rank [0.2, 0.2], other rank 0.9s again: batch 3.1 / 5 = 0.62 -> global stays 0.62, ratio 1
    assert torch.allclose(s(torch.tensor([0.2, 0.2])), torch.tensor([0.2, 0.2]))
    local = DiversitySmoother(beta=0.7, distributed=False)
    local(torch.tensor([0.1, 0.3]))
    assert local.batch_avg == pytest.approx(0.2)
