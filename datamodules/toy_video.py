"""The toy video world: short procedural clips of the toy shapes, with repeated events and exact temporal labels.

The temporal and spatio-temporal counterpart of ``datamodules/toy.py`` for CycleGRPO (docs/toy_world.md, "The toy
video world"). A clip is ``num_frames`` frames (default 16) of ``size x size`` pixels (default 112) at ``fps`` frames
per second (default 2, so 8 s); frame ``i`` is shown at ``t = i / fps``. On a plain neutral background:

- the **actor**, a shape of one size, moves two or three times (each move 2 or 4 frames long, rests of 2 or 4 frames
  between them) and may change colour between moves;
- one or two **other objects** of other shapes and colours, some appearing part-way through, some moving once, so
  that "something moves" never names the actor's move.

The actor's moves are **repeated events**: the query names one of them and the clip is built so that only the
intended cue tells it apart from the others (docs/toy_world.md has the table):

- ``order``: every move goes the same way in the same colour; only "the second time ..." singles one out;
- ``outcome``: every move is in the same colour, the target's direction is unique ("... moves up");
- ``state``: every move goes the same way, the actor wears a colour during the target move that it wears during no
  other move ("... moves left while it is blue").

A fraction of queries (``SPLITS[split].no_target``) asks for a move that never happens (a fourth time, a direction
never taken, a colour never worn while moving): their label is "no target" (no interval, no anchors).

Labels are exact by construction: event boundaries are frame indices (even ones, so that they fall on Qwen2.5-VL's
temporal patches of 2 frames), the queried event's interval is ``[start_frame / fps, end_frame / fps]`` seconds (the
actor is at its start position up to ``start_frame`` and at its end position from ``end_frame`` on, moving in
between), and every frame's box of every object is the tight box of its drawn pixels (``grammar.draw_shape``; boxes
never overlap, 2 px apart, so every object is fully visible). ``anchors`` are the actor's ``(t, box)`` on every frame
of the queried event; ``lookalikes`` the intervals of the actor's other moves (the distractor regions of the
``Locatability`` metric).

Every clip is seeded by (seed, split, index): the same arguments give the same bytes, and a split of n clips is a
prefix of a split of n + k.

CLI: ``python -m datamodules.toy_video --out data/toy_video --splits train:256 val:64 --seed 0``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from core.regions import AnchorSpace, IntervalSpace
from core.toy.grammar import COLOURS, OBJECT_COLOURS, SHAPES, SIZE_FRACTIONS, SIZES, draw_shape
from core.video import VideoClip, video_processor_kwargs
from datamodules.toy import split_counts
from datamodules.toy_export import atomic_write, claim, reusable

TOY_VIDEO_VERSION = 1
"""Bump when the generator's output changes, so exported splits with a stale manifest are regenerated."""
MODES = ("order", "outcome", "state")
DIRECTIONS: dict[str, tuple[int, int]] = {"left": (-1, 0), "right": (1, 0), "up": (0, -1), "down": (0, 1)}
ORDINALS = ("first", "second", "third", "fourth", "fifth")
BACKGROUND_COLOURS = ("white", "gray", "black")
GAP = 2
"""Pixels kept between any two objects' boxes on every frame (no occlusion: every label box is fully visible)."""
_VIDEO_SEED_TAG = 1717
"""Enters the seed so a video clip never shares random numbers with the image scene of the same index."""


@dataclass(frozen=True)
class VideoSplitSpec:
    """How one split's clips are drawn."""

    code: int
    """Enters the seed, so splits never share clips."""
    others: tuple[int, int]
    """Inclusive range of non-actor objects."""
    no_target: float
    """Fraction of clips whose query asks for a move that never happens."""


SPLITS: dict[str, VideoSplitSpec] = {
    "train": VideoSplitSpec(0, (1, 2), 0.1),
    "val": VideoSplitSpec(1, (1, 2), 0.1),
    "test": VideoSplitSpec(2, (1, 2), 0.1),
}


def _rng(seed: int, split: str, index: int) -> np.random.Generator:
    if seed < 0:
        raise ValueError(f"--seed must be >= 0, got {seed}")
    return np.random.default_rng(np.random.SeedSequence([seed, _VIDEO_SEED_TAG, SPLITS[split].code, index]))


def _check_args(split: str, size: int, num_frames: int, fps: float) -> None:
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; choose one of {tuple(SPLITS)}")
    if size < 64 or size % 28:
        raise ValueError(f"--size must be a multiple of 28 (Qwen2.5-VL's merged patch) and >= 64 pixels, got {size}")
    if num_frames < 12 or num_frames % 2:
        raise ValueError(f"--num_frames must be even (temporal patches of 2 frames) and >= 12, got {num_frames}")
    if not fps > 0:
        raise ValueError(f"--fps must be > 0, got {fps}")


def _pick(rng: np.random.Generator, values: Sequence[Any]) -> Any:
    return values[int(rng.integers(len(values)))]


def _side(rng: np.random.Generator, size_word: str, image_size: int) -> int:
    lo, hi = SIZE_FRACTIONS[size_word]
    return max(5, int(round(rng.uniform(lo, hi) * image_size)))


# --- tracks --------------------------------------------------------------------------------------------------------


def _track(
    rng: np.random.Generator,
    side: int,
    moves: Sequence[tuple[int, int, str]],
    image_size: int,
    num_frames: int,
) -> list[tuple[int, int, int, int]] | None:
    """Boxes of one object on every frame for ``moves`` = [(start_frame, end_frame, direction)]: a random start that
    keeps the whole path inside the image (2 px margin), each move a random distance. None when the path cannot fit."""
    steps = []
    for _, _, direction in moves:
        dist = int(round(rng.uniform(0.18, 0.3) * image_size))
        dx, dy = DIRECTIONS[direction]
        steps.append((dx * dist, dy * dist))
    # cumulative offsets after each move: the start must keep all of them inside
    offsets = np.cumsum(np.array([(0, 0), *steps]), axis=0)
    lo, hi = 2, image_size - side - 2
    x_lo, x_hi = lo - offsets[:, 0].min(), hi - offsets[:, 0].max()
    y_lo, y_hi = lo - offsets[:, 1].min(), hi - offsets[:, 1].max()
    if x_lo > x_hi or y_lo > y_hi:
        return None
    x, y = int(rng.integers(x_lo, x_hi + 1)), int(rng.integers(y_lo, y_hi + 1))
    positions: list[tuple[int, int]] = []
    cur = (x, y)
    pending = sorted(zip(moves, steps), key=lambda m: m[0][0])
    for f in range(num_frames):
        pos = cur
        for (s, e, _), (dx, dy) in pending:
            if s < f <= e:  # moving: linear from the position at s to the one at e, rounded to pixels
                frac = (f - s) / (e - s)
                pos = (cur[0] + int(round(dx * frac)), cur[1] + int(round(dy * frac)))
                if f == e:
                    cur = pos
        positions.append(pos)
    return [(px, py, px + side, py + side) for px, py in positions]


def _apart(a: Sequence[int] | None, b: Sequence[int] | None) -> bool:
    if a is None or b is None:
        return True
    return a[0] >= b[2] + GAP or b[0] >= a[2] + GAP or a[1] >= b[3] + GAP or b[1] >= a[3] + GAP


def _schedule(rng: np.random.Generator, n_moves: int, num_frames: int) -> list[tuple[int, int]] | None:
    """(start, end) frames of ``n_moves`` moves: rests and durations of 2 or 4 frames, all boundaries even."""
    frames, out = 0, []
    for _ in range(n_moves):
        start = frames + int(_pick(rng, (2, 4)))
        end = start + int(_pick(rng, (2, 4)))
        out.append((start, end))
        frames = end
    return out if frames <= num_frames - 2 else None


# --- queries -------------------------------------------------------------------------------------------------------


def query_text(q: dict[str, Any]) -> str:
    """The query sentence of a structured query (``meta["query_spec"]``)."""
    actor = f"the {q['size']} {q['shape']}"
    if q["mode"] == "order":
        return f"the {ORDINALS[q['ordinal'] - 1]} time {actor} moves"
    if q["mode"] == "outcome":
        return f"{actor} moves {q['direction']}"
    return f"{actor} moves {q['direction']} while it is {q['colour']}"


def resolve_query(q: dict[str, Any], meta: dict[str, Any]) -> list[int]:
    """Indices into ``meta["events"]`` of every move the structured query ``q`` describes: the moves of objects of
    the named shape and size, then the k-th by time (order), those in the direction (outcome), or those in the
    direction while wearing the colour (state). A well-posed query resolves to one event, a no-target query to none.
    """
    objects = {o["id"]: o for o in meta["objects"]}
    moves = [
        i
        for i, ev in enumerate(meta["events"])
        if ev["type"] == "move"
        and (objects[ev["object"]]["shape"], objects[ev["object"]]["size"]) == (q["shape"], q["size"])
    ]
    moves.sort(key=lambda i: meta["events"][i]["start_frame"])
    if q["mode"] == "order":
        return [moves[q["ordinal"] - 1]] if q["ordinal"] <= len(moves) else []
    hits = [i for i in moves if meta["events"][i]["direction"] == q["direction"]]
    if q["mode"] == "state":
        hits = [i for i in hits if meta["events"][i]["colour"] == q["colour"]]
    return hits


# --- clips ---------------------------------------------------------------------------------------------------------


def _actor_plan(rng: np.random.Generator, mode: str, n_moves: int, target: int) -> tuple[list[str], list[str]]:
    """Directions and colours of the actor's moves such that only ``mode``'s cue singles out move ``target``."""
    direction = _pick(rng, tuple(DIRECTIONS))
    colour = _pick(rng, OBJECT_COLOURS)
    directions, colours = [direction] * n_moves, [colour] * n_moves
    if mode == "outcome":  # the others share one other direction, so "moves <dir>" is unique only for the target
        other = _pick(rng, [d for d in DIRECTIONS if d != direction])
        directions = [direction if k == target else other for k in range(n_moves)]
    elif mode == "state":  # the target wears its own colour, the others share one
        other = _pick(rng, [c for c in OBJECT_COLOURS if c != colour])
        colours = [colour if k == target else other for k in range(n_moves)]
    return directions, colours


def _layout(rng: np.random.Generator, split: str, mode: str, size: int, num_frames: int) -> dict[str, Any] | None:
    """One attempt at a clip's objects, events and tracks (None when something does not fit)."""
    spec = SPLITS[split]
    n_moves = int(rng.integers(2, 4))
    schedule = _schedule(rng, n_moves, num_frames)
    if schedule is None:
        return None
    target = int(rng.integers(n_moves))
    directions, colours = _actor_plan(rng, mode, n_moves, target)
    actor_shape, actor_size = _pick(rng, SHAPES), _pick(rng, SIZES)
    side = _side(rng, actor_size, size)
    boxes = _track(rng, side, [(s, e, d) for (s, e), d in zip(schedule, directions)], size, num_frames)
    if boxes is None:
        return None
    # colour on every frame: a move's colour holds from the middle of the rest before it (frame 0 for the first)
    colour_frames = [colours[0]] * num_frames
    events: list[dict[str, Any]] = []
    for k in range(1, n_moves):
        if colours[k] != colours[k - 1]:
            switch = (schedule[k - 1][1] + schedule[k][0]) // 2 + 1  # strictly after the previous move ended
            colour_frames[switch:] = [colours[k]] * (num_frames - switch)
            events.append(
                {
                    "type": "recolour",
                    "object": 0,
                    "start_frame": switch,
                    "end_frame": switch,
                    "colour": colours[k],
                    "previous": colours[k - 1],
                }
            )
    for (s, e), d in zip(schedule, directions):
        events.append(
            {"type": "move", "object": 0, "start_frame": s, "end_frame": e, "direction": d, "colour": colour_frames[s]}
        )
    objects = [
        {"id": 0, "role": "actor", "shape": actor_shape, "size": actor_size, "colours": colour_frames, "boxes": boxes}
    ]

    # other objects: other shapes, colours the actor never wears, maybe appearing late, maybe moving once
    free_shapes = [s for s in SHAPES if s != actor_shape]
    free_colours = [c for c in OBJECT_COLOURS if c not in set(colours)]
    for oid in range(1, int(rng.integers(spec.others[0], spec.others[1] + 1)) + 1):
        shape = free_shapes.pop(int(rng.integers(len(free_shapes))))
        colour = free_colours.pop(int(rng.integers(len(free_colours))))
        size_word = _pick(rng, SIZES)
        o_side = _side(rng, size_word, size)
        appear = 0 if rng.random() < 0.6 else 2 * int(rng.integers(1, num_frames // 2 - 2))  # <= num_frames - 6
        o_moves = []
        if rng.random() < 0.6:
            s = 2 * int(rng.integers(appear // 2, num_frames // 2 - 2))  # ends by num_frames - 4
            o_moves = [(s, s + 2, _pick(rng, tuple(DIRECTIONS)))]
        for _ in range(20):
            track = _track(rng, o_side, o_moves, size, num_frames)
            if track is None:
                continue
            track = [b if f >= appear else None for f, b in enumerate(track)]
            if all(_apart(track[f], o["boxes"][f]) for o in objects for f in range(num_frames)):
                break
        else:
            return None  # no room for this object: draw the clip again
        objects.append(
            {
                "id": oid,
                "role": "object",
                "shape": shape,
                "size": size_word,
                "colours": [colour] * num_frames,
                "boxes": track,
            }
        )
        if appear:
            events.append({"type": "appear", "object": oid, "start_frame": appear, "end_frame": appear})
        for s, e, d in o_moves:
            events.append(
                {"type": "move", "object": oid, "start_frame": s, "end_frame": e, "direction": d, "colour": colour}
            )
    events.sort(key=lambda ev: (ev["start_frame"], ev["object"], ev["type"]))
    target_event = next(
        i
        for i, ev in enumerate(events)
        if ev["type"] == "move" and ev["object"] == 0 and ev["start_frame"] == schedule[target][0]
    )
    return {"objects": objects, "events": events, "target_event": target_event, "n_moves": n_moves}


def _no_target_query(rng: np.random.Generator, q: dict[str, Any], meta: dict[str, Any]) -> dict[str, Any]:
    """Turn a well-posed query into one that asks for a move that never happens."""
    actor = meta["objects"][0]
    moves = [ev for ev in meta["events"] if ev["type"] == "move" and ev["object"] == 0]
    q = dict(q)
    if q["mode"] == "order":
        q["ordinal"] = len(moves) + 1
    elif q["mode"] == "outcome":
        q["direction"] = _pick(rng, [d for d in DIRECTIONS if d not in {ev["direction"] for ev in moves}])
    else:
        q["colour"] = _pick(rng, [c for c in OBJECT_COLOURS if c not in set(actor["colours"])])
    return q


def make_clip(split: str, index: int, seed: int, size: int = 112, num_frames: int = 16, fps: float = 2.0) -> dict:
    """One clip record: the JSONL keys of ``export_jsonl`` with ``frames`` a list of PIL images, and ``meta`` the
    clip (objects with per-frame boxes and colours, events, the structured query)."""
    _check_args(split, size, num_frames, fps)
    rng = _rng(seed, split, index)
    mode = _pick(rng, MODES)
    no_target = bool(rng.random() < SPLITS[split].no_target)
    background = _pick(rng, BACKGROUND_COLOURS)
    for _ in range(200):
        clip = _layout(rng, split, mode, size, num_frames)
        if clip is not None:
            break
    else:  # pragma: no cover - the plan always fits at the sizes _check_args allows
        raise RuntimeError(f"{split} clip {index}: no layout fits in 200 tries; use a larger --size")

    actor = clip["objects"][0]
    target = clip["events"][clip["target_event"]]
    q: dict[str, Any] = {"mode": mode, "shape": actor["shape"], "size": actor["size"]}
    if mode == "order":
        actor_moves = [ev for ev in clip["events"] if ev["type"] == "move" and ev["object"] == 0]
        q["ordinal"] = 1 + actor_moves.index(target)
    else:
        q["direction"] = target["direction"]
        if mode == "state":
            q["colour"] = target["colour"]
    meta = {
        "split": split,
        "index": index,
        "seed": seed,
        "width": size,
        "height": size,
        "fps": fps,
        "num_frames": num_frames,
        "background": background,
        "objects": clip["objects"],
        "events": clip["events"],
    }
    if no_target:
        q = _no_target_query(rng, q, meta)
    hits = resolve_query(q, meta)
    if len(hits) != (0 if no_target else 1) or (not no_target and hits[0] != clip["target_event"]):
        raise AssertionError(f"{split} clip {index}: query {q} resolves to events {hits}")  # a generator bug
    meta["query_spec"] = q
    meta["query"] = query_text(q)
    meta["target_event"] = None if no_target else clip["target_event"]

    if no_target:
        solution: list = []
        anchors: list = []
    else:
        s, e = target["start_frame"], target["end_frame"]
        solution = [[s / fps, e / fps]]
        anchors = [[f / fps, list(actor["boxes"][f])] for f in range(s, e + 1)]
    # the actor's other moves: where a caption that names only the kind of event grounds (``Locatability``)
    lookalikes = [
        [ev["start_frame"] / fps, ev["end_frame"] / fps]
        for i, ev in enumerate(meta["events"])
        if ev["type"] == "move" and ev["object"] == 0 and i != meta["target_event"]
    ]
    answer = IntervalSpace().serialize(solution or [])
    return {
        "id": f"toyvid-{split}-{index:06d}",
        "frames": render_frames(meta),
        "conversations": [
            {"from": "human", "value": f"<video>{meta['query']}"},
            {"from": "gpt", "value": answer},
        ],
        "solution": solution,
        "anchors": anchors,
        "anchors_text": AnchorSpace().serialize(anchors or []),
        "lookalikes": lookalikes,
        "task": "video",
        "fps": fps,
        "num_frames": num_frames,
        "duration": num_frames / fps,
        "width": size,
        "height": size,
        "meta": meta,
    }


def render_frames(meta: dict[str, Any]) -> list[Image.Image]:
    """The clip's frames as RGB PIL images, drawn from ``meta`` alone (objects' per-frame boxes and colours)."""
    size_w, size_h, n = meta["width"], meta["height"], meta["num_frames"]
    bg = np.array(COLOURS[meta["background"]], dtype=np.uint8)
    frames = []
    for f in range(n):
        canvas = np.empty((size_h, size_w, 3), dtype=np.uint8)
        canvas[:] = bg
        for obj in meta["objects"]:
            box = obj["boxes"][f]
            if box is not None:
                drawn = draw_shape(canvas, obj["shape"], obj["colours"][f], box)
                assert drawn == tuple(box), "objects stay inside the frame, so the drawn box is the label box"
        frames.append(Image.fromarray(canvas))
    return frames


def iter_split(split: str, n: int, seed: int, **kwargs: Any) -> Iterator[dict[str, Any]]:
    for index in range(n):
        yield make_clip(split, index, seed, **kwargs)


# --- Qwen2.5-VL video input ------------------------------------------------------------------------------------------


def load_frames(record: dict[str, Any], root: str | Path | None = None) -> list[Image.Image]:
    """A clip's frames as a list of RGB PIL images: ``record["frames"]`` if present, else the exported
    ``record["video"]`` npz (relative to ``root``), else rendered from ``record["meta"]``."""
    if record.get("frames") is not None:
        return list(record["frames"])
    if record.get("video"):
        path = Path(root or ".") / record["video"]
        if not path.exists():
            raise FileNotFoundError(
                f"clip {record.get('id')!r}: {path} is missing; re-export with datamodules.toy_video"
            )
        with np.load(path) as data:
            return [Image.fromarray(frame) for frame in data["frames"]]
    if record.get("meta"):
        return render_frames(record["meta"])
    raise ValueError(f"clip {record.get('id')!r} has neither frames, a video file nor meta to render from")


def qwen_video_kwargs(
    record: dict[str, Any], frames: list[Image.Image] | None = None, root: str | Path | None = None
) -> dict[str, Any]:
    """Keyword arguments for a Qwen2.5-VL processor call that feed one clip as a video, at its true frame rate and
    native size: ``processor(text=[...], **qwen_video_kwargs(record), return_tensors="pt")``. ``frames`` / ``root``
    as ``load_frames`` (an exported record's ``video`` is relative to the export folder). The rule is
    ``core.video.video_processor_kwargs`` (the rollout engines' own): ``video_metadata`` carries the fps (without it
    transformers assumes 24 fps, and ``second_per_grid_ts`` becomes 2 / 24), ``do_sample_frames=False`` keeps every
    frame (16 frames -> 8 temporal patches), and the pixel budget pinned to ``width * height`` keeps the 112 x 112
    frames as they are (8 x 8 patches of 14 px, 4 x 4 = 16 tokens per temporal patch after the 2 x 2 merge).
    """
    frames = frames if frames is not None else load_frames(record, root)
    return video_processor_kwargs([VideoClip(frames, float(record.get("fps") or record["meta"]["fps"]))])


# --- export ----------------------------------------------------------------------------------------------------------


def jsonl_path(out_dir: str | Path, split: str) -> Path:
    """``out_dir/{split}_video.jsonl`` (so clips can share a folder with the image world's ``{split}.jsonl``)."""
    return Path(out_dir) / f"{split}_video.jsonl"


def export_jsonl(
    out_dir: str | Path, split: str, n: int, seed: int, size: int = 112, num_frames: int = 16, fps: float = 2.0
) -> Path:
    """Write ``n`` clips of ``split`` as ``videos/{id}.npz`` (``frames``: uint8 ``[T, H, W, 3]``) and a JSONL
    (``jsonl_path``) whose ``video`` paths are relative to ``out_dir``; returns the JSONL path.

    Idempotent like ``datamodules.toy.export_jsonl``: a manifest written last records the parameters, and a call
    with the same parameters whose files all exist returns at once. Files are written to temp names and renamed.
    """
    _check_args(split, size, num_frames, fps)
    out_dir = Path(out_dir)
    path = jsonl_path(out_dir, split)
    manifest = path.with_name(path.name + ".manifest.json")
    params = {
        "generator": "datamodules.toy_video",
        "version": TOY_VIDEO_VERSION,
        "split": split,
        "n": n,
        "seed": seed,
        "size": size,
        "num_frames": num_frames,
        "fps": fps,
    }
    if reusable(path, manifest, params, file_key="video"):
        return path
    (claim(out_dir) / "videos").mkdir(exist_ok=True)  # a folder of other files stops it here
    manifest.unlink(missing_ok=True)
    lines = []
    for rec in iter_split(split, n, seed, size=size, num_frames=num_frames, fps=fps):
        rel = f"videos/{rec['id']}.npz"
        stack = np.stack([np.asarray(f) for f in rec.pop("frames")])
        atomic_write(out_dir / rel, lambda p, a=stack: np.savez_compressed(p, frames=a))
        lines.append(json.dumps({"id": rec.pop("id"), "video": rel, **rec}) + "\n")
    atomic_write(path, lambda p: p.write_text("".join(lines)))
    atomic_write(manifest, lambda p: p.write_text(json.dumps(params, indent=1) + "\n"))
    return path


def main(argv: Sequence[str] | None = None) -> list[Path]:
    parser = argparse.ArgumentParser(prog="python -m datamodules.toy_video", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("data/toy_video"), help="output folder (videos/, *.jsonl)")
    parser.add_argument(
        "--splits",
        nargs="+",
        default=["train:256", "val:64"],
        help="split:count pairs, splits from " + ", ".join(SPLITS),
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=112, help="square frame side in pixels (a multiple of 28)")
    parser.add_argument("--num_frames", type=int, default=16, help="frames per clip (even)")
    parser.add_argument("--fps", type=float, default=2.0, help="frames per second (clip length = num_frames / fps)")
    args = parser.parse_args(argv)
    paths = []
    for split, count in split_counts(parser, args.splits, SPLITS):
        paths.append(export_jsonl(args.out, split, count, args.seed, args.size, args.num_frames, args.fps))
        print(paths[-1])
    return paths


if __name__ == "__main__":
    main()
