"""The mask-token text grammar of CycleGRPO's policy (paper 002; the released repository's VQ-SAM2 tokens).

A mask is two codes from two unshared residual codebooks of ``CODEBOOK_SIZE`` entries each, written as four added
tokens::

    <|mt_start|><|mt_0017|><|mt_0300|><|mt_end|>      # codes (17, 44): the second codebook is offset by 256

Every code token is ``<|mt_%04d|>`` of its *global* index, ``codebook * CODEBOOK_SIZE + code``, so the 512 code
tokens ``<|mt_0000|>``..``<|mt_0511|>`` are shared by all codebooks and a code can only ever be read in the slot of
its own codebook. In Python a mask is the tuple of its *raw* per-codebook indices, each in ``0..CODEBOOK_SIZE - 1``;
only the text carries the offset.

``parse_masks`` reads every well-formed span and skips the rest without raising: a span with a missing or extra code,
a code in the wrong codebook's range, or an unterminated span reads as nothing (the policy's output is untrusted).
Whitespace between the four tokens of a span is tolerated (a tokenizer's decode may insert it); the digits of a code
token are always four. Pure Python: no torch, no tokenizer.
"""

from __future__ import annotations

import re

__all__ = [
    "CODEBOOK_SIZE",
    "MT_END",
    "MT_START",
    "NUM_CODEBOOKS",
    "code_token",
    "format_mask",
    "mask_token_strings",
    "parse_masks",
]

MT_START = "<|mt_start|>"
MT_END = "<|mt_end|>"
CODEBOOK_SIZE = 256
NUM_CODEBOOKS = 2

# one span: start, first code token, second code token, end (digits captured as text, ranges checked in Python)
_SPAN_RE = re.compile(r"<\|mt_start\|>\s*<\|mt_(\d{4})\|>\s*<\|mt_(\d{4})\|>\s*<\|mt_end\|>")


def code_token(global_index: int) -> str:
    """The token string of one code's global index (``codebook * CODEBOOK_SIZE + code``): 300 -> ``<|mt_0300|>``."""
    if not 0 <= global_index < NUM_CODEBOOKS * CODEBOOK_SIZE:
        raise ValueError(
            f"a mask code token's index must lie in [0, {NUM_CODEBOOKS * CODEBOOK_SIZE}), got {global_index}"
        )
    return f"<|mt_{global_index:04d}|>"


def mask_token_strings() -> list[str]:
    """All ``2 + NUM_CODEBOOKS * CODEBOOK_SIZE`` (= 514) added token strings, in vocabulary order: ``MT_START``,
    ``<|mt_0000|>``..``<|mt_0511|>``, then ``MT_END``, the order of the repository's
    ``projects/vlm/tokenmask/utils/add_special_tokens.py`` (line 99), so tokens added to a base tokenizer here get the
    ids a released tokenizer gives them (base vocabulary + 0, + 1 .. + 512, + 513)."""
    return [MT_START, *(code_token(i) for i in range(NUM_CODEBOOKS * CODEBOOK_SIZE)), MT_END]


def format_mask(codes: tuple[int, int]) -> str:
    """The text of one mask from its raw per-codebook codes: ``(17, 44)`` -> ``<|mt_start|><|mt_0017|><|mt_0300|>
    <|mt_end|>`` (no spaces)."""
    codes = tuple(codes)
    if len(codes) != NUM_CODEBOOKS:
        raise ValueError(f"a mask has {NUM_CODEBOOKS} codes (one per codebook), got {len(codes)}: {codes!r}")
    parts = []
    for book, code in enumerate(codes):
        if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code < CODEBOOK_SIZE:
            raise ValueError(
                f"codebook {book}'s code must be an int in [0, {CODEBOOK_SIZE}) (raw index, no offset), got {code!r}"
            )
        parts.append(code_token(book * CODEBOOK_SIZE + code))
    return MT_START + "".join(parts) + MT_END


def parse_masks(text: str) -> list[tuple[int, int]]:
    """Raw per-codebook codes of every well-formed mask span in ``text``, left to right; malformed spans are skipped.

    ``"a <|mt_start|><|mt_0017|><|mt_0300|><|mt_end|> b"`` -> ``[(17, 44)]``; a second code below 256 or a first code
    above 255 is a code in the wrong codebook and the span is skipped. Never raises (non-strings read as ``[]``).
    """
    if not isinstance(text, str):
        return []
    out: list[tuple[int, int]] = []
    for m in _SPAN_RE.finditer(text):
        first, second = int(m.group(1)), int(m.group(2))
        if 0 <= first < CODEBOOK_SIZE and CODEBOOK_SIZE <= second < 2 * CODEBOOK_SIZE:
            out.append((first, second - CODEBOOK_SIZE))
    return out
