"""The toy model's SFT completions: the four-part target of a toy-world record (``sft_target``) and the reasoning
of a sub-problem completion (``format_steps``), in integer pixels of the model input."""

from __future__ import annotations

import json
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from core.toy import grammar
from core.toy.query import Desc, QueryParseError, Step, parse_query
from core.toy.scene import difficulty


def _scale_box(box: Sequence[float], sx: float, sy: float, input_wh: tuple[int, int]) -> list[int]:
    w, h = input_wh
    x1, y1, x2, y2 = box
    return [
        int(np.clip(np.floor(x1 * sx + 0.5), 0, w)),
        int(np.clip(np.floor(y1 * sy + 0.5), 0, h)),
        int(np.clip(np.floor(x2 * sx + 0.5), 0, w)),
        int(np.clip(np.floor(y2 * sy + 0.5), 0, h)),
    ]


def _query(record: dict[str, Any]) -> str:
    for key in ("query", "problem"):  # a Sample-like dict, or VLM-R1's alternative key
        if isinstance(record.get(key), str):
            return record[key].replace("<image>", "").strip()
    for turn in record.get("conversations", []):
        if turn.get("from") in ("human", "user"):
            return str(turn.get("value", "")).replace("<image>", "").strip()
    return str((record.get("meta") or {}).get("query", ""))


def sft_target(
    record: dict[str, Any], input_wh: tuple[int, int], grounded_think: bool = False, named_only: bool = False
) -> str:
    """The four-part completion that warm-starts the toy model on ``record``.

    ``<think>`` a templated reasoning grounded in the scene, ``<diversity>`` the scene's ``difficulty``,
    ``<description>`` a random grammar description seeded by the record id, ``<answer>`` the box (OVD: the list of
    boxes) in integer pixels of the model input of size ``input_wh`` = (width, height), scaled from the original
    size as Qwen2.5-VL answers on the resized image.

    ``named_only`` (the toy base's target, ``toy_base``): a plain attribute query's reasoning looks for what the query
    names and nothing else ("I look for red shapes and find only one."), so a base taught on one-attribute queries
    never reads the target's full triple in its own reasoning.
    """
    meta = record.get("meta") or {}
    query = _query(record)
    objects = meta.get("objects", [])
    task = record.get("task", "rec")
    absent = task == "rec" and not record.get("solution")  # a no-target query (``SplitSpec.no_target``)
    if absent:
        size, colour, shape = query.split()[-3:] if len(query.split()) >= 3 else ("", "", query)
        same = [o for o in objects if o["colour"] == colour and o["shape"] == shape]
        found = f"find {len(same)}, and none is {size}" if same else "find none"
        think = f"The query asks for {query}. I look for {colour} {grammar.plural(shape)} and {found}."
    elif task == "rec" and objects and named_only and (desc := _plain_desc(query)) is not None:
        words = desc.words()
        n = sum(desc.matches(o) for o in objects)
        found = "find only one" if n == 1 else f"find {n}"
        think = (
            f"The query asks for {query}. I look for {' '.join(words[:-1] + [grammar.plural(words[-1])])} and {found}."
        )
    elif task == "rec" and objects:
        t = next(o for o in objects if o["role"] == "target")
        kind = f"{t['colour']} {grammar.plural(t['shape'])}"
        same = sum(o["colour"] == t["colour"] and o["shape"] == t["shape"] for o in objects)
        found = "find only one" if same == 1 else f"find {same}, and pick the {t['size']} one"
        think = f"The query asks for {query}. I look for {kind} and {found}."
    elif task == "ovd" and objects:
        n = sum(o["role"] == "target" for o in objects)
        colour = next(o["colour"] for o in objects if o["role"] == "target")
        think = f"The query asks for {query}. I look for {colour} shapes and find {n}."
    else:
        think = f"The query asks for {query}. I look for it in the image."
    value = meta.get("difficulty")
    value = difficulty(record) if value is None and objects else (0.5 if value is None else float(value))
    seed = zlib.crc32(str(record.get("id", query)).encode())
    description = grammar.random_description(np.random.default_rng(seed))

    w0 = record.get("width") or meta.get("width")
    h0 = record.get("height") or meta.get("height")
    if not (w0 and h0):
        raise ValueError(f"record {record.get('id')!r} needs 'width' and 'height' to scale its box to the model input")
    sx, sy = input_wh[0] / w0, input_wh[1] / h0
    solution = record["solution"]
    if absent:
        answer = "no target"  # core.regions.NO_TARGET_TEXT
    elif task == "ovd":
        answer = json.dumps([_scale_box(b, sx, sy, input_wh) for b in solution])
    else:
        box = solution[0] if solution and isinstance(solution[0], list) else solution
        answer = json.dumps(_scale_box(box, sx, sy, input_wh))
    if grounded_think:  # state where it is first, as grounded reasoning traces do; the answer then repeats it
        think = f"It is not in the image. {think}" if absent else f"It is at {answer}. {think}"
    return (
        f"<think>{think}</think><diversity>{value:.2f}</diversity>"
        f"<description>{description}</description><answer>{answer}</answer>"
    )


def _plain_desc(query: str) -> Desc | None:
    """The descriptor of a plain attribute query ("the red shape", "the small red circle"); None for anything else."""
    try:
        np_ = parse_query(query)
    except QueryParseError:
        return None
    plain = np_.region is None and np_.negate is None and np_.relation is None and np_.ordinal is None
    return np_.desc if plain else None


def format_steps(
    steps: Sequence[Step],
    input_wh: tuple[int, int],
    orig_wh: tuple[int, int],
    queries: bool = True,
    relative: bool = False,
) -> str:
    """The reasoning of a sub-problem completion, to go inside ``<think>``: one sentence per step with its box in a
    ``<step>`` tag, in integer pixels of the model input (as ``toy.sft_target`` writes answers), e.g.
    ``Step 1: the red square <step>[60, 20, 110, 70]</step>. Step 2: the circle below the red square <step>[...]</step>.``;
    ``relative=True`` names a step's predecessor "it" (``Step 2: the circle below it <step>[...]</step>.``: each step
    says what to look for next and stays short, the toy model's named form); ``queries=False`` leaves the steps'
    queries out (``Step 1: <step>[60, 20, 110, 70]</step>.``: the short form, docs/decisions.md)."""
    sx, sy = input_wh[0] / orig_wh[0], input_wh[1] / orig_wh[1]
    parts = []
    for k, s in enumerate(steps, 1):
        x1, y1, x2, y2 = s.box
        box = [int(np.floor(v * f + 0.5)) for v, f in ((x1, sx), (y1, sy), (x2, sx), (y2, sy))]
        query = s.query
        if relative and k > 1 and query.endswith(" " + steps[k - 2].query):
            query = query[: -len(steps[k - 2].query)] + "it"
        parts.append(
            f"Step {k}: {query} <step>{json.dumps(box)}</step>."
            if queries
            else f"Step {k}: <step>{json.dumps(box)}</step>."
        )
    return " ".join(parts)
