"""The description grammar: exact round trip, lenient parsing that never raises, masked pixels kept bit for bit."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from PIL import Image

from core.toy import grammar
from core.toy.grammar import (
    BACKGROUNDS,
    COLOURS,
    COUNT_RANGES,
    COUNTS,
    SHAPES,
    SIZES,
    Description,
    draw_shape,
    format_description,
    parse_description,
    random_description,
    render,
    render_with_layout,
    shape_mask,
)

NAMES = list(COLOURS)
DISTRACTORS = [("no", None, None, None)] + list(itertools.product(COUNTS[1:], SHAPES, NAMES, SIZES))
BACKS = list(itertools.product(BACKGROUNDS, NAMES, [None, *NAMES]))

descriptions = st.builds(
    lambda back, dis: Description(*back, *dis), st.sampled_from(BACKS), st.sampled_from(DISTRACTORS)
)


def test_canonical_text():
    d = Description("striped", "blue", "white", "many", "triangle", "green", "small")
    assert format_description(d) == "a striped blue and white background with many small green triangles"
    assert str(Description()) == "a plain white background with no distractors"
    assert (
        format_description(Description("dotted", "gray", count="few", shape="cross", shape_colour="red", size="large"))
        == "a dotted gray background with few large red crosses"
    )


def test_round_trip_every_background_and_every_distractor_group():
    # parsing binds background and distractor words separately, so covering each part fully (936 backgrounds x
    # one group, one background x 433 groups) plus a random sample of pairs covers the product
    for back in BACKS:
        d = Description(*back, "some", "star", "pink", "large")
        assert parse_description(format_description(d)) == d
    for dis in DISTRACTORS:
        d = Description("checkered", "black", "yellow", *dis)
        assert parse_description(format_description(d)) == d
    rng = np.random.default_rng(0)
    for _ in range(3000):
        d = Description(*BACKS[rng.integers(len(BACKS))], *DISTRACTORS[rng.integers(len(DISTRACTORS))])
        assert parse_description(format_description(d)) == d


@given(descriptions)
def test_round_trip_property(d):
    assert parse_description(format_description(d)) == d
    assert parse_description(format_description(d).upper()) == d


def test_description_normalises_and_validates():
    # "no distractors" drops the distractor fields, so the text says everything the value holds
    assert Description(count="no", shape="star", shape_colour="red", size="large") == Description()
    d = Description("plain", "red", count="few")
    assert (d.shape, d.size) == ("circle", "small") and d.shape_colour != "red"
    with pytest.raises(ValueError, match="background"):
        Description("wavy")
    with pytest.raises(ValueError, match="shape_colour"):
        Description(count="few", shape_colour="mauve")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        (
            "Many tiny GREEN triangles on a Striped blue background.",
            Description("striped", "blue", None, "many", "triangle", "green", "small"),
        ),
        ("a grey backdrop", Description("plain", "gray")),
        ("red", Description("plain", "red")),
        ("lots of big stars", Description("plain", "white", None, "many", "star", "red", "large")),
        (
            "3 yellow circles, blue and white checkerboard",
            Description("checkered", "blue", "white", "few", "circle", "yellow", "small"),
        ),
        ("A dog in a messy living room with knit blanket", None),
        ("", None),
    ],
)
def test_parse_free_text(text, expected):
    assert parse_description(text) == expected


@settings(max_examples=300)
@given(st.text())
def test_parse_never_raises_on_any_text(text):
    d = parse_description(text)
    assert d is None or parse_description(format_description(d)) == d


VOCAB = [
    "a",
    "and",
    "with",
    "no",
    "background",
    "shapes",
    "12",
    "99999",
    "0",
    "stripes",
    *BACKGROUNDS,
    *NAMES,
    *SHAPES,
    *SIZES,
    *COUNTS,
    "crosses",
    "grey",
    "big",
]


@settings(max_examples=300)
@given(st.lists(st.sampled_from(VOCAB), max_size=12))
def test_parse_grammar_word_soup(words):
    d = parse_description(" ".join(words))
    assert d is None or isinstance(d, Description)
    if d is not None:  # a parse is a fixed point of format -> parse
        assert parse_description(format_description(d)) == d


def test_parse_rejects_non_strings():
    assert parse_description(None) is None
    assert parse_description(b"red") is None


def test_random_description_is_valid_and_varied():
    rng = np.random.default_rng(1)
    ds = [random_description(rng) for _ in range(400)]
    assert {d.background for d in ds} == set(BACKGROUNDS) and {d.count for d in ds} == set(COUNTS)
    for d in ds:
        assert parse_description(format_description(d)) == d
        assert d.count == "no" or d.shape_colour not in (d.colour, d.colour2)
        assert (d.colour2 is None) == (d.background == "plain")


@pytest.mark.parametrize("shape", SHAPES)
def test_shape_masks_are_tight(shape):
    for w in range(1, 70):
        for h in {w, max(1, w // 2), 2 * w, w + 1}:
            m = shape_mask(shape, w, h)
            assert m.shape == (h, w)
            assert m[0].any() and m[-1].any() and m[:, 0].any() and m[:, -1].any(), (w, h)


def test_draw_shape_box_clipping_and_pil():
    canvas = np.zeros((40, 50, 3), np.uint8)
    mask = np.zeros((40, 50), bool)
    assert draw_shape(canvas, "circle", "red", (10, 5, 30, 25), mask=mask) == (10, 5, 30, 25)
    ys, xs = np.nonzero((canvas == COLOURS["red"]).all(-1))
    assert (xs.min(), ys.min(), xs.max() + 1, ys.max() + 1) == (10, 5, 30, 25)
    assert mask.sum() == len(xs)
    assert draw_shape(canvas, "square", (1, 2, 3), (40, 30, 60, 50)) == (40, 30, 50, 40)  # clipped to the canvas
    assert draw_shape(canvas, "square", "red", (60, 0, 70, 10)) is None
    im = Image.new("RGB", (50, 40))
    draw_shape(im, "star", "blue", (5, 5, 35, 35))
    ref = np.zeros((40, 50, 3), np.uint8)
    draw_shape(ref, "star", "blue", (5, 5, 35, 35))
    assert np.array_equal(np.asarray(im), ref)


def _scene(seed: int, h: int, w: int) -> tuple[Image.Image, np.ndarray]:
    rng = np.random.default_rng(seed)
    image = Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))
    keep = rng.random((h, w)) < rng.uniform(0, 0.3)  # scattered pixels ...
    for _ in range(rng.integers(0, 4)):  # ... and solid rectangles, as a box mask would be
        x1, y1 = rng.integers(0, w), rng.integers(0, h)
        keep[y1 : y1 + rng.integers(1, h), x1 : x1 + rng.integers(1, w)] = True
    return image, keep


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), descriptions, st.integers(0, 2**40), st.integers(8, 80), st.integers(8, 80))
def test_render_keeps_masked_pixels_bit_identical(scene_seed, d, seed, h, w):
    image, keep = _scene(scene_seed, h, w)
    out = render(image, keep, d, seed)
    assert out.mode == "RGB" and out.size == image.size
    assert np.array_equal(np.asarray(out)[keep], np.asarray(image)[keep])


def test_render_is_deterministic_and_seeded():
    image, keep = _scene(3, 96, 128)
    d = Description("noisy", "blue", "yellow", "some", "diamond", "red", "small")
    a, b = render(image, keep, d, 7), render(image, keep, format_description(d), 7)
    assert a.tobytes() == b.tobytes()
    assert render(image, keep, d, 8).tobytes() != a.tobytes()


def test_render_paints_what_the_description_says():
    image = Image.new("RGB", (64, 48), (1, 2, 3))
    keep = np.zeros((48, 64), bool)
    keep[10:20, 10:30] = True
    out = np.asarray(render(image, keep, "a plain red background with no distractors", 0))
    assert (out[~keep] == COLOURS["red"]).all() and (out[keep] == (1, 2, 3)).all()
    # two-colour textures show exactly their two colours
    out = np.asarray(render(image, keep, Description("checkered", "black", "white"), 0))
    assert {tuple(p) for p in out[~keep]} == {COLOURS["black"], COLOURS["white"]}


@pytest.mark.parametrize("count", COUNTS)
def test_distractor_count_and_avoidance(count):
    d = Description("plain", "white", count=count, shape="square", shape_colour="red", size="small")
    keep = np.zeros((224, 224), bool)
    keep[80:140, 80:140] = True
    for seed in range(5):
        _, placed = render_with_layout(Image.new("RGB", (224, 224)), keep, d, seed)
        lo, hi = COUNT_RANGES[count]
        assert lo <= len(placed) <= hi
        for p in placed:  # plenty of room: no distractor touches the kept region
            x1, y1, x2, y2 = p.box
            assert not keep[y1:y2, x1:x2].any()
            assert 0 <= x1 < x2 <= 224 and 0 <= y1 < y2 <= 224
    _, placed = render_with_layout(
        Image.new("RGB", (224, 224)), keep, d.__class__("plain", count="many"), 0, n_distractors=2
    )
    assert len(placed) == 2


def test_render_errors_name_the_problem():
    image = Image.new("RGB", (32, 32))
    with pytest.raises(ValueError, match="keep_mask"):
        render(image, np.zeros((31, 32), bool), Description(), 0)
    with pytest.raises(ValueError, match="no background, colour or shape word"):
        render(image, np.zeros((32, 32), bool), "a dog in a room", 0)


def test_count_word():
    assert [grammar.count_word(n) for n in (0, 1, 3, 4, 6, 7, 10, 50)] == [
        "no",
        "few",
        "few",
        "some",
        "some",
        "many",
        "many",
        "many",
    ]
