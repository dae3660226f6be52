"""Literal tests of the mask-token grammar (core/regions/mask_tokens.py)."""

from __future__ import annotations

import pytest

from core.regions.mask_tokens import (
    CODEBOOK_SIZE,
    MT_END,
    MT_START,
    NUM_CODEBOOKS,
    code_token,
    format_mask,
    mask_token_strings,
    parse_masks,
)


def test_constants_and_token_list():
    assert (MT_START, MT_END, CODEBOOK_SIZE, NUM_CODEBOOKS) == ("<|mt_start|>", "<|mt_end|>", 256, 2)
    toks = mask_token_strings()
    # 2 delimiters + 2 codebooks x 256 codes
    assert len(toks) == 514 and len(set(toks)) == 514
    # the repository's order, <|mt_end|> last (projects/vlm/tokenmask/utils/add_special_tokens.py line 99)
    assert toks[:3] == ["<|mt_start|>", "<|mt_0000|>", "<|mt_0001|>"]
    assert toks[-2:] == ["<|mt_0511|>", "<|mt_end|>"]
    assert toks[1 + 256] == "<|mt_0256|>"  # the first code of the second codebook


def test_format_mask_offsets_the_second_codebook():
    assert format_mask((17, 44)) == "<|mt_start|><|mt_0017|><|mt_0300|><|mt_end|>"  # 44 + 256 = 300
    assert format_mask((0, 0)) == "<|mt_start|><|mt_0000|><|mt_0256|><|mt_end|>"
    assert format_mask((255, 255)) == "<|mt_start|><|mt_0255|><|mt_0511|><|mt_end|>"


@pytest.mark.parametrize("bad", [(256, 0), (0, 256), (-1, 3), (1,), (1, 2, 3), (1.0, 2), (True, 2)])
def test_format_mask_rejects_bad_codes(bad):
    with pytest.raises(ValueError, match="code"):
        format_mask(bad)


def test_code_token_range():
    assert code_token(300) == "<|mt_0300|>"
    with pytest.raises(ValueError, match="512"):
        code_token(512)


def test_parse_round_trip_and_surrounding_text():
    text = f"the cup {format_mask((17, 44))} and the plate {format_mask((255, 0))}."
    assert parse_masks(text) == [(17, 44), (255, 0)]
    assert parse_masks(format_mask((3, 4)) * 3) == [(3, 4)] * 3  # adjacent spans
    # whitespace between a span's tokens (a decode may add it)
    assert parse_masks("<|mt_start|> <|mt_0001|> <|mt_0257|> <|mt_end|>") == [(1, 1)]


@pytest.mark.parametrize(
    "text",
    [
        "",
        "No target.",
        "<|mt_start|><|mt_0017|><|mt_end|>",  # one code
        "<|mt_start|><|mt_0017|><|mt_0300|><|mt_0301|><|mt_end|>",  # three codes
        "<|mt_start|><|mt_0017|><|mt_0300|>",  # unterminated
        "<|mt_0017|><|mt_0300|><|mt_end|>",  # no start
        "<|mt_start|><|mt_0300|><|mt_0017|><|mt_end|>",  # codebooks swapped
        "<|mt_start|><|mt_0017|><|mt_0018|><|mt_end|>",  # second code in the first codebook's range
        "<|mt_start|><|mt_0017|><|mt_0512|><|mt_end|>",  # past the vocabulary
        "<|mt_start|><|mt_17|><|mt_300|><|mt_end|>",  # not four digits
        "<|mt_start|><|mt_9999|><|mt_0300|><|mt_end|>",  # the repository's filler code
    ],
)
def test_parse_skips_malformed_spans(text):
    assert parse_masks(text) == []


def test_parse_keeps_good_spans_beside_bad_ones_and_never_raises():
    good = format_mask((5, 6))
    assert parse_masks(f"<|mt_start|><|mt_0017|><|mt_end|> {good} <|mt_start|><|mt_0400|><|mt_0300|><|mt_end|>") == [
        (5, 6)
    ]
    assert parse_masks(None) == [] and parse_masks(12) == []  # type: ignore[arg-type]
