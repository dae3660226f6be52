"""CycleGRPO's mask regions (``--model.method.init_args.region_space mask``): regions written as mask tokens.

A region is a bool pixel mask of the sample's image and its text is one mask-token span per object,
``<|mt_start|><|mt_0017|><|mt_0300|><|mt_end|>`` (docs/mask_tokens.md), encoded and decoded by a mask tokenizer
loaded once from ``--model.method.init_args.mask_tokenizer`` (a toy tokenizer folder: ``config.json`` +
``model.safetensors``; rebuild it with ``python -m cli.mask_tokenizer --out checkpoints/toy-mask-tokenizer``).

Per sample (`MaskRegions`, cached by the sample object for the step):

- one ``space.for_image(sample.image)``: the token-mode space bound to its image, shared by the captioning prompt,
  the N captions' N x K groundings and the no-target groundings (its decode cache holds the codes they repeat);
- the ground truth, first found of: the sample's exact mask (``meta["mask"]``: GRES records,
  ``datamodules/cycle_seg.py``); its target's mask tokens (``meta["mask_codes"]``: the released RL parquet's rows,
  decoded on the image; ``[]`` is no target); the toy world's exact visible target mask
  (``core.toy.masks.target_mask(meta)``, resized to the sample's image when a data module downscaled it); the filled
  rectangles of its boxes; a sample without any of these (a no-target query) is ``NO_TARGET``;
- the captioning prompt shows the ground truth's span: the row's own codes when ``meta["mask_codes"]`` holds them
  (the parquet's prompt and answer are those codes, so the token reward compares against them, not a re-encoding of
  their decoded mask), else the tokenizer's two codes of the mask, prompted with its tight box;
- a grounding's region is the union of the decoded spans of its answer part (``raw_caption``); captions lose their
  mask tokens before they are grounded (``caption_text``; a caption that writes one pays the leak in ``Phi_cap``);
- consistency ``s`` (``mask_reward``, ``core.regions.mask_rewards.mask_consistency``): ``tokens`` (default, the
  released repository's): 1.0 when the answer's codes equal the ground truth's, 0.4 when only the first does, 0
  otherwise (several spans: the best match of each / max(#pred, #gt)); ``iou`` (paper 004's alternative): the
  decoded spans matched one-to-one to the exact mask by IoU, ``sum / max(#pred, 1)``. An answer with no readable
  span, or a no-target query, scores with the region spaces' no-target table (1 for "no target" against no target,
  0 otherwise), so junk never counts as a rejection.

**Where and how the tokenizer decodes.** It runs on ``mask_device`` when the config names one, else on the policy's
device (`MaskRegions.place` at each rollout and evaluation; VQ-SAM2 moves, the toy tokenizer stays on the CPU). A
step decodes in batches (`MaskRegions.prefetch`): the ground truths' spans at the rollout, then every grounding's
spans at scoring, one ``decode_batch`` call for all of them, each distinct code pair of a sample once (the bound
space's cache, keyed by the code pair, holds them for the step); VQ-SAM2's ``decode_batch`` encodes each image once.
The ``repository`` composition decodes nothing while training (it compares span strings).

The ceiling of ``iou`` is the tokenizer's round-trip IoU (0.942 for the toy tokenizer, experiments/mask_tokenizer.md):
a perfect grounder writes the ground truth's own codes, which decode to an approximation of the exact mask.
"""

from __future__ import annotations

import itertools
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from core.prompts import PROMPT_TEMPLATES
from core.regions import NO_TARGET, MaskSpace, region_space
from core.regions.checks import has_mask_token_leak
from core.regions.mask_rewards import MASK_CONSISTENCIES, mask_consistency, no_target_reward
from core.regions.mask_tokens import format_mask, parse_masks
from core.toy.masks import object_masks, target_mask
from lightning_modules.engines.base import RolloutRequest, Sampling, build_rollout_engine
from lightning_modules.methods.cycle_rewards import raw_caption
from lightning_modules.models.mask_tokenizer.toy import ToyMaskTokenizer
from lightning_modules.models.mask_tokenizer.vocab import mask_token_ids
from lightning_modules.models.mask_tokenizer.vq_sam2 import VQSam2MaskTokenizer
from lightning_modules.models.prompts import build_prompt_text

__all__ = [
    "MASK_REWARDS",
    "REBUILD",
    "SFT_KINDS",
    "MaskRegions",
    "MaskSFT",
    "MaskSFTSpec",
    "detailed_caption",
    "gt_pixel_mask",
    "load_mask_codec",
    "lookalike_masks",
]

MASK_REWARDS = MASK_CONSISTENCIES
"""``--model.method.init_args.mask_reward``: ``tokens`` (code match 1 / 0.4 / 0) or ``iou`` (decoded mask IoU)."""
REBUILD = "python -m cli.mask_tokenizer --out checkpoints/toy-mask-tokenizer"
_FLAG = "--model.method.init_args.mask_tokenizer"


def _released_codec(folder: Path):
    """The release's VQ-SAM2 from a folder holding its tokenizer state (one ``*.pth``, e.g. ``mask_tokenizer_256x2.pth``)
    and SAM 2 (a transformers folder ``sam2/``, or Meta's ``sam2*.pt``); None when the folder holds no ``.pth``."""
    states = sorted(folder.glob("*.pth"))
    if not states:
        return None
    sam2 = [p for p in (folder / "sam2",) if (p / "config.json").is_file()] + sorted(folder.glob("sam2*.pt"))
    if len(states) > 1 or len(sam2) != 1:
        raise FileNotFoundError(
            f"{_FLAG} {str(folder)!r}: a released VQ-SAM2 folder holds one tokenizer state (*.pth, found "
            f"{[p.name for p in states]}) and one SAM 2 (a transformers folder sam2/ or sam2*.pt, found "
            f"{[p.name for p in sam2]})"
        )
    return VQSam2MaskTokenizer.from_files(sam2[0], states[0])


def load_mask_codec(path: str | None):
    """The mask tokenizer of ``region_space: mask`` from its folder: the toy tokenizer's format (``config.json`` +
    ``model.safetensors``), or the release's VQ-SAM2 (`_released_codec`: its ``.pth`` beside SAM 2's weights), with
    errors that name the flag and the rebuild command."""
    if not path:
        raise ValueError(
            f"--model.method.init_args.region_space mask writes regions as mask tokens and needs a mask tokenizer: set "
            f"{_FLAG} to its folder (e.g. checkpoints/toy-mask-tokenizer, built by `{REBUILD}`)"
        )
    folder = Path(path)
    if folder.is_dir() and (released := _released_codec(folder)) is not None:
        return released
    if not (folder / "config.json").is_file() or not (folder / "model.safetensors").is_file():
        raise FileNotFoundError(
            f"{_FLAG} {str(path)!r}: no mask tokenizer there (config.json + model.safetensors, or the release's "
            f"mask_tokenizer_256x2.pth beside SAM 2's weights); build the toy one with `{REBUILD}` (seeded, about 4 "
            "minutes on one CPU core)"
        )
    return ToyMaskTokenizer.load(folder)


def _fit(mask: np.ndarray, w: int, h: int) -> np.ndarray:
    """``mask`` at the sample's image size (a data module that downscaled the image: nearest, as labels resize)."""
    if mask.shape != (h, w):
        mask = np.asarray(Image.fromarray(mask).resize((w, h), Image.NEAREST), dtype=bool)
    return mask


def gt_pixel_mask(sample, decode: Callable[[tuple[int, int]], np.ndarray] | None = None) -> np.ndarray:
    """``sample``'s ground-truth target as a bool ``[H, W]`` mask of its image (module docstring): ``meta["mask"]``
    (an exact mask), else the union of ``meta["mask_codes"]`` decoded by ``decode`` (codes -> mask on this image),
    else the toy scene's exact visible target mask when ``meta`` holds its objects, else its boxes filled; all False
    without any (no target)."""
    w, h = sample.size
    meta = getattr(sample, "meta", None) or {}
    if meta.get("mask") is not None:
        return _fit(np.asarray(meta["mask"], dtype=bool), w, h)
    if meta.get("mask_codes") is not None:
        union = np.zeros((h, w), dtype=bool)
        if meta["mask_codes"] and decode is None:
            raise ValueError(
                f"{getattr(sample, 'source', sample.sample_id)}: the sample's target is given as mask tokens "
                "(meta['mask_codes']); decoding them needs the mask tokenizer: gt_pixel_mask(sample, decode=...)"
            )
        for pair in meta["mask_codes"]:
            union |= _fit(np.asarray(decode(tuple(pair)), dtype=bool), w, h)
        return union
    if not len(sample.boxes):
        return np.zeros((h, w), dtype=bool)
    if meta.get("objects") and "height" in meta and "width" in meta:
        mask = _fit(target_mask(meta), w, h)
        if mask.any():
            return mask
    mask = np.zeros((h, w), dtype=bool)
    for x1, y1, x2, y2 in sample.boxes:
        xa, ya = max(int(round(float(x1))), 0), max(int(round(float(y1))), 0)
        mask[ya : max(int(round(float(y2))), ya + 1), xa : max(int(round(float(x2))), xa + 1)] = True
    return mask


def lookalike_masks(sample) -> list[np.ndarray]:
    """The exact visible masks of the scene's other objects sharing the target's shape or colour (as
    ``cycle_rewards.image_lookalikes`` picks their boxes); none for data without ``meta.objects``."""
    meta = getattr(sample, "meta", None) or {}
    objects = meta.get("objects") or []
    target = next((o for o in objects if o.get("role") == "target"), None)
    if target is None or "height" not in meta:
        return []
    picked = [
        i
        for i, o in enumerate(objects)
        if o is not target and (o.get("shape") == target.get("shape") or o.get("colour") == target.get("colour"))
    ]
    if not picked:
        return []
    masks = object_masks(meta)
    w, h = sample.size
    out = []
    for i in picked:
        m = masks[i]
        if m.shape != (h, w):
            m = np.asarray(Image.fromarray(m).resize((w, h), Image.NEAREST), dtype=bool)
        out.append(m)
    return out


class _Entry:
    __slots__ = ("codes", "gt", "sample", "space")

    def __init__(self, sample, space: MaskSpace):
        self.sample, self.space = sample, space
        self.gt: Any = None
        self.codes: list[tuple[int, int]] | None = None


class MaskRegions:
    """The mask tokenizer, the token-mode space and, per sample, its bound space, ground truth and ground-truth codes
    (module docstring)."""

    CACHE = 64
    """Samples whose bound space (and its decoded masks) is kept; emptied when full, so a long run holds at most this
    many (a step's or an eval batch's samples; a larger batch only recomputes)."""

    def __init__(self, mask_tokenizer: str | None, mask_reward: str = "tokens", device: str | None = None):
        if mask_reward not in MASK_REWARDS:
            raise ValueError(
                f"--model.method.init_args.mask_reward must be one of {MASK_REWARDS} (tokens: code match 1 / 0.4 / 0; "
                f"iou: decoded mask IoU), got {mask_reward!r}"
            )
        self.reward = mask_reward
        self.codec = load_mask_codec(mask_tokenizer)
        self.device = device
        """Where the tokenizer runs: a device name, or None to follow the policy (`place`)."""
        if device is not None:
            self._to(device)
        self.space: MaskSpace = region_space("mask", codec=self.codec)
        self._cache: dict[int, _Entry] = {}
        self._checked: set[int] = set()
        self._mark: tuple[float, float, int] | None = None
        """The tokenizer's counters at the step's start (`mark`)."""

    def check_processor(self, processor) -> None:
        """Raise (once per processor) when the policy's tokenizer lacks the mask tokens."""
        if id(processor) not in self._checked:
            mask_token_ids(processor)  # names --model.policy.mask_tokens true
            self._checked.add(id(processor))

    def _entry(self, sample) -> _Entry:
        entry = self._cache.get(id(sample))
        if entry is None or entry.sample is not sample:  # the entry holds the sample, so its id is not reused
            if len(self._cache) >= self.CACHE:
                self._cache.clear()
            entry = self._cache[id(sample)] = _Entry(sample, self.space.for_image(sample.image))
        return entry

    def _to(self, device) -> None:
        mover = getattr(self.codec, "to", None)  # VQ-SAM2 moves; the toy tokenizer is CPU-only
        if callable(mover):
            mover(device)

    def place(self, policy_device) -> None:
        """Put the tokenizer on the configured device, else on the policy's (a no-op once it is there)."""
        self._to(self.device if self.device is not None else policy_device)

    def prefetch(self, items: Iterable[tuple[Any, str]]) -> int:
        """Decode, in one ``decode_batch`` call, every span of the ``(sample, text)`` pairs (the part `predicted`
        reads) that the samples' bound spaces have not decoded yet, each distinct code pair of a sample once; returns
        how many were decoded. A tokenizer without ``decode_batch`` decodes them one by one."""
        todo: dict[tuple[int, tuple[int, int]], MaskSpace] = {}
        for sample, text in items:
            space = self.bound(sample)
            for codes in space.codes(raw_caption(text)):
                if not space.is_decoded(codes):
                    todo.setdefault((id(space), codes), space)
        if not todo:
            return 0
        codes = [key[1] for key in todo]
        images = [space.image for space in todo.values()]
        batch = getattr(self.codec, "decode_batch", None)
        masks = batch(codes, images) if callable(batch) else [self.codec.decode(c, im) for c, im in zip(codes, images)]
        for space, pair, mask in zip(todo.values(), codes, masks):
            space.store(pair, mask)
        return len(codes)

    def mark(self) -> None:
        """Start a step's count of the tokenizer's work (`step_logs`)."""
        self._mark = self._counters()

    def step_logs(self) -> dict[str, float]:
        """The tokenizer's work since `mark`: ``train/cycle/mask_decode_s`` / ``mask_encode_s`` (wall seconds of its
        decode / encode calls, device work included) and ``mask_decodes`` (code pairs decoded); empty for a tokenizer
        that keeps no counters (the toy's)."""
        now, then = self._counters(), self._mark
        if now is None or then is None:
            return {}
        keys = ("mask_decode_s", "mask_encode_s", "mask_decodes")
        return {f"train/cycle/{k}": float(a - b) for k, a, b in zip(keys, now, then)}

    def _counters(self) -> tuple[float, float, int] | None:
        seconds = getattr(self.codec, "seconds", None)
        if seconds is None:
            return None
        return seconds["decode"], seconds["encode"], self.codec.n_decoded

    def bound(self, sample) -> MaskSpace:
        """The token-mode space bound to ``sample``'s image (one per sample)."""
        return self._entry(sample).space

    def gt(self, sample) -> Any:
        """The ground-truth region: a read-only bool pixel mask, or ``NO_TARGET``."""
        entry = self._entry(sample)
        if entry.gt is None:
            entry.gt = entry.space.normalize(gt_pixel_mask(sample, decode=entry.space.decode))
        return entry.gt

    def gt_codes(self, sample) -> list[tuple[int, int]]:
        """The ground truth's code pairs (``[]`` for no target)."""
        entry = self._entry(sample)
        if entry.codes is None:
            entry.codes = entry.space.codes(self.region_text(sample))
        return entry.codes

    def region_text(self, sample) -> str:
        """The ground truth as the captioning prompt shows it (and a perfect grounding writes it): its span; the
        sample's own spans when ``meta["mask_codes"]`` gives them (``, ``-separated, as the released prompts list
        several)."""
        codes = (getattr(sample, "meta", None) or {}).get("mask_codes")
        if codes:
            return ", ".join(format_mask(tuple(c)) for c in codes)
        return self.bound(sample).serialize(self.gt(sample))

    def predicted(self, sample, text: str) -> Any:
        """The region a grounding answers: the union of its answer part's decoded spans, ``NO_TARGET``, or None."""
        return self.bound(sample).parse(raw_caption(text))

    def consistency(self, sample, gt: Any, pred: Any, text: str) -> float:
        """``s`` of a grounding ``text`` (its region ``pred``, from `predicted`) against ``gt`` (the sample's ground
        truth, or ``NO_TARGET`` for a no-target query): the mask consistency ``mask_reward`` when both hold masks,
        else the no-target table."""
        space = self.bound(sample)
        if gt is NO_TARGET or pred is None or pred is NO_TARGET:
            return space.consistency(gt, pred)
        pred_codes = space.codes(raw_caption(text))
        return mask_consistency(pred_codes, self.gt_codes(sample), self.reward, decode=space.decode, gt_masks=[gt])


# --- the mask-token co-SFT cold start ---------------------------------------------------------------------------------

SFT_KINDS = ("brief", "detailed", "segment")
"""What a sample with a target teaches (``MaskSFTSpec.mix``); a sample without one always teaches the rejection."""
_WORDS = ("no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine")


@dataclass
class MaskSFTSpec:
    """The co-SFT cold start of region_space mask (``--model.mask_sft``; docs/cycle_grpo.md, "The cold start"): each
    training sample becomes one example, its kind drawn by id. Brief caption: ``brief_template`` shows the target's
    mask-token span(s), the answer is the referring expression; detailed caption: ``detailed_template``, the answer a
    longer description (``meta["detailed_caption"]``, or the toy scene's, from its objects; a brief one without);
    segment: ``grounding_template`` asks the expression, the answer is the span(s); no target (a sample without one):
    the expression asked the same way, answered ``no_target_answer``."""

    mask_tokenizer: str = "checkpoints/toy-mask-tokenizer"
    """The tokenizer whose codes the spans are (the RL run's ``--model.method.init_args.mask_tokenizer``)."""
    mix: dict[str, float] = field(default_factory=lambda: {"brief": 0.25, "detailed": 0.25, "segment": 0.5})
    """Kind -> weight, for samples with a target (``SFT_KINDS``)."""
    brief_template: str = "toy_caption"
    detailed_template: str = "caption"
    grounding_template: str = "toy"
    no_target_answer: str = "No target."
    seed: int = 0


def _position(box, w: int, h: int) -> str:
    cx, cy = (box[0] + box[2]) / 2 / w, (box[1] + box[3]) / 2 / h
    row = "upper" if cy < 1 / 3 else "lower" if cy > 2 / 3 else "middle"
    col = "left" if cx < 1 / 3 else "right" if cx > 2 / 3 else "centre"
    return "centre" if (row, col) == ("middle", "centre") else f"{row} {col}"


def detailed_caption(sample) -> str | None:
    """``meta["detailed_caption"]``, or the toy scene's target described from its objects (size, colour, shape, where
    in the image in words, how many of its shape the scene holds: no coordinates); None for other data."""
    meta = getattr(sample, "meta", None) or {}
    if meta.get("detailed_caption"):
        return str(meta["detailed_caption"])
    objects = meta.get("objects") or []
    t = next((o for o in objects if o.get("role") == "target"), None)
    if t is None or "box" not in t or "width" not in meta:
        return None
    same = sum(o.get("shape") == t["shape"] for o in objects)
    kin = f"the only {t['shape']}" if same == 1 else f"one of {_WORDS[min(same, 9)]} {t['shape']}s"
    where = _position(t["box"], meta["width"], meta["height"])
    return f"the {t['size']} {t['colour']} {t['shape']} in the {where} of the image, {kin} in the scene"


class MaskSFT:
    """`MaskSFTSpec`'s examples and their greedy validation (``SFTModule``'s mask-token hook)."""

    def __init__(self, spec: MaskSFTSpec):
        bad = {k: v for k, v in spec.mix.items() if k not in SFT_KINDS or v < 0}
        if bad or not sum(spec.mix.values()) > 0:
            raise ValueError(f"--model.mask_sft.mix: non-negative weights of {SFT_KINDS}, not all 0; got {spec.mix}")
        for key in ("brief_template", "detailed_template", "grounding_template"):
            if getattr(spec, key) not in PROMPT_TEMPLATES:
                raise ValueError(f"--model.mask_sft.{key} {getattr(spec, key)!r} is not a prompt template")
        self.spec = spec
        self._regions: MaskRegions | None = None

    @property
    def regions(self) -> MaskRegions:
        """The tokenizer and per-sample ground truth, loaded on first use (in the loader worker that encodes)."""
        if self._regions is None:
            self._regions = MaskRegions(self.spec.mask_tokenizer)
        return self._regions

    def kind(self, sample) -> str:
        """``no_target`` for a sample without a target, else one of ``mix``, drawn by the sample's id."""
        codes = (sample.meta or {}).get("mask_codes")
        if not (codes if codes is not None else len(sample.boxes)):
            return "no_target"
        kinds = [k for k in SFT_KINDS if self.spec.mix.get(k, 0) > 0]
        weights = [self.spec.mix[k] for k in kinds]
        u = zlib.crc32(f"{self.spec.seed}/{sample.sample_id}/mask_sft".encode()) / 2**32 * sum(weights)
        return next((k for k, c in zip(kinds, itertools.accumulate(weights)) if u < c), kinds[-1])

    def example(self, processor, sample) -> tuple[str, str, str]:
        """(chat prompt, target, kind) of ``sample``."""
        kind, s = self.kind(sample), self.spec
        if kind != "no_target" and not sample.query:
            raise ValueError(
                f"{sample.source or sample.sample_id}: a {kind} example needs the region's expression, and "
                "this sample has none (the released parquet's region rows carry no caption: train the cold start on "
                "GRES, --data.init_args.gres)"
            )
        if kind == "no_target":
            return (
                build_prompt_text(processor, sample.query, template=s.grounding_template),
                self._answer(s.no_target_answer),
                kind,
            )
        spans = self.regions.region_text(sample)
        if kind == "segment":
            return build_prompt_text(processor, sample.query, template=s.grounding_template), self._answer(spans), kind
        text = sample.query if kind == "brief" else (detailed_caption(sample) or sample.query)
        template = s.brief_template if kind == "brief" else s.detailed_template
        return build_prompt_text(processor, spans, template=template), self._answer(text), kind

    @staticmethod
    def _answer(text: str) -> str:
        return f"<answer>{text}</answer>"

    @torch.no_grad()
    def evaluate(self, policy, processor, batch, max_new_tokens: int, prefix: str) -> dict[str, tuple[float, int]]:
        """Each example answered greedily: ``<prefix>/mask_span_rate`` (segment examples whose answer writes a
        well-formed span), ``mask_code_acc`` (its first span's codes are the target's), ``no_target_acc`` (no-target
        examples answered with the rejection and no span), ``caption_exact`` (captions equal to the target) and
        ``caption_clean`` (captions without any mask token); each as (value, count)."""
        examples = [self.example(processor, s) for s in batch]
        requests = [RolloutRequest(p, s.image, 1, i) for i, (s, (p, _, _)) in enumerate(zip(batch, examples))]
        sampling = Sampling(max_new_tokens=max_new_tokens, greedy=True)
        texts = build_rollout_engine("hf").generate(policy, processor, requests, sampling).texts
        scores: dict[str, list[float]] = {}
        for (_, target, kind), text in zip(examples, texts):
            answer, want = raw_caption(text), raw_caption(target)
            codes = parse_masks(answer)
            if kind == "segment":
                row = {"mask_span_rate": bool(codes), "mask_code_acc": codes[:1] == parse_masks(want)[:1]}
            elif kind == "no_target":
                row = {"no_target_acc": no_target_reward(answer, bool(codes)) == 1.0}
            else:
                row = {"caption_exact": answer.strip() == want.strip(), "caption_clean": not has_mask_token_leak(text)}
            for k, v in row.items():
                scores.setdefault(f"{prefix}/{k}", []).append(float(v))
        return {k: (sum(v) / len(v), len(v)) for k, v in scores.items()}
