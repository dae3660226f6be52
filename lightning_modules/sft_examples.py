"""SFTModule's examples: how a training sample becomes a (prompt, target) pair, and a batch the model's inputs.

A batch is one of four kinds, each with its own prompts and targets (`SFTExamples.encode`):

- **images** (REC / OVD samples): the prompt is the sample's query under its template (``prompt_template``, one per
  sample fixed by its id when several are mixed), the target one of `TARGETS` (``target``); a captioning sample
  (``caption_frac``, fixed by id) shows the target's box under ``caption_template`` instead and answers its query,
  CycleGRPO's other direction;
- **clips** (toy video samples): prompts and region texts of ``methods/cycle_grpo.py`` itself, in each clip's region
  space (`SFTExamples.clip_example`);
- **mask-token examples** (``mask_sft``: ``methods/cycle_masks.MaskSFT``);
- **toy math pairs** (``datamodules.sft_math.MathPair``): A's or Q's prompt as the EvolvedGRPO methods ask it
  (`pair_prompt`).

The loss sees the targets only: the prompt's tokens are labelled -100.
"""

from __future__ import annotations

import re
import zlib

import torch

from core import rewards
from core.math_prompts import answer_prompt
from core.prompts import PROMPT_TEMPLATES
from core.regions import region_space
from datamodules.evolve import query_steps
from datamodules.sft_targets import format_steps, sft_target
from lightning_modules.methods.base import MethodContext
from lightning_modules.methods.cycle_grpo import CycleGRPO
from lightning_modules.methods.cycle_masks import MaskSFT, MaskSFTSpec
from lightning_modules.methods.cycle_regions import VIDEO_SPACES
from lightning_modules.methods.math_answer import chat_prompt
from lightning_modules.methods.question_generator import question_prompt
from lightning_modules.models.prompts import build_prompt_text
from lightning_modules.models.qwen_vl import box_frame, box_frame_wh, model_input_size, processor_inputs

__all__ = ["TARGETS", "VIDEO_TEMPLATES", "SFTExamples", "pair_prompt"]


def answer_target(sample, input_wh: tuple[int, int], seed: int = 0) -> str:
    """The paper's SFT baseline target: the ground-truth box in model-input pixels inside answer tags."""
    w, h = sample.size
    sx, sy = input_wh[0] / w, input_wh[1] / h
    boxes = [[round(b[0] * sx), round(b[1] * sy), round(b[2] * sx), round(b[3] * sy)] for b in sample.boxes]
    body = (boxes[0] if boxes else "no target") if sample.task == "rec" else boxes  # no box: a no-target query
    return f"<answer>{body}</answer>"


def _toy_record(sample) -> dict:
    """A toy-world sample as the JSONL record ``datamodules.sft_targets.sft_target`` reads."""
    return {
        "id": sample.sample_id,
        "solution": (sample.boxes[0] if sample.boxes else []) if sample.task == "rec" else sample.boxes,
        "task": sample.task,
        "meta": sample.meta,
        "width": sample.size[0],
        "height": sample.size[1],
        "query": sample.query,
    }


def toy_target(sample, input_wh: tuple[int, int], seed: int = 0) -> str:
    """The 4-part toy target (``datamodules.sft_targets.sft_target``) for a toy-world sample."""
    return sft_target(_toy_record(sample), input_wh)


def toy_grounded_target(sample, input_wh: tuple[int, int], seed: int = 0) -> str:
    """``toy_target`` whose reasoning starts by stating the box (``It is at [...]``), then repeats it as the answer."""
    return sft_target(_toy_record(sample), input_wh, grounded_think=True)


def toy_base_target(sample, input_wh: tuple[int, int], seed: int = 0) -> str:
    """``toy_grounded_target`` whose reasoning looks for what the query names only (the toy base: docs/toy_model.md)."""
    return sft_target(_toy_record(sample), input_wh, grounded_think=True, named_only=True)


def _toy_target_with_steps(sample, input_wh: tuple[int, int], seed: int, **step_format) -> str:
    """``toy_grounded_target``, except that a multi-step question's reasoning walks its steps (``format_steps`` with
    ``step_format``), then states the box."""
    text = toy_grounded_target(sample, input_wh, seed)
    steps = query_steps(sample.meta or {}, sample.query) if sample.task == "rec" else []
    if len(steps) < 2:
        return text
    head, rest = text.split("</think>", 1)
    located = head.removeprefix("<think>").split(". ", 1)[0]  # "It is at [x1, y1, x2, y2]"
    return f"<think>{format_steps(steps, input_wh, sample.size, **step_format)} {located}.</think>{rest}"


def toy_steps_target(sample, input_wh: tuple[int, int], seed: int = 0) -> str:
    """``toy_grounded_target``, except that for a multi-step question (EvolvedGRPO's relations and sub-problems) the
    reasoning walks its steps, one ``<step>[box]</step>`` each, anchor first, then states the box
    (``<think>Step 1: <step>[..]</step>. Step 2: <step>[..]</step>. It is at [..].</think>``): the format the prefix
    process reward of ``evolved_grpo`` reads, in the short form (no step queries: docs/decisions.md)."""
    return _toy_target_with_steps(sample, input_wh, seed, queries=False)


def toy_steps_named_target(sample, input_wh: tuple[int, int], seed: int = 0) -> str:
    """``toy_steps_target`` whose steps name what they look for, each after the first relative to its predecessor
    (``Step 1: the cyan shape <step>[..]</step>. Step 2: the large triangle right of it <step>[..]</step>. ...``): the
    anchor's phrase is copied out of the question before its box; about 5 tokens a step longer. Measured worse than
    the short form on the toy model (experiments/toy_model_runs.md, "The anchors' query form")."""
    return _toy_target_with_steps(sample, input_wh, seed, relative=True)


TARGETS = {
    "answer": answer_target,
    "toy": toy_target,
    "toy_grounded": toy_grounded_target,
    "toy_base": toy_base_target,
    "toy_steps": toy_steps_target,
    "toy_steps_named": toy_steps_named_target,
}
"""``--model.target``: how an image sample becomes its completion, ``fn(sample, input_wh, seed) -> str``."""


def pair_prompt(processor, pair) -> str:
    """The chat prompt of a toy math SFT pair (``datamodules.sft_math.MathPair``): A's prompt as ``MathAnswer`` asks
    it, or Q's as ``QuestionGenerator`` does, so the math stage teaches what the EvolvedGRPO runs ask."""
    if pair.role == "answer":
        return chat_prompt(processor, answer_prompt(pair.problem))
    return chat_prompt(processor, question_prompt(pair.problem, pair.answer, pair.kind))


VIDEO_TEMPLATES = {"interval": "toy_temporal", "anchor": "toy_st"}
"""The toy checkpoint's grounding prompt of clips in each region space (``SFTModule(video_templates=...)``)."""


class SFTExamples:
    """The (prompt, target) pairs of `SFTModule`'s settings of the same names (its docstring), checked here (the
    flags in the messages are ``--model.*``)."""

    def __init__(
        self,
        target: str = "toy",
        prompt_template: str | list[str] = "toy",
        seed: int = 0,
        caption_frac: float = 0.0,
        caption_template: str = "toy_caption",
        video_spaces: list[str] | None = None,
        video_templates: dict[str, str] | None = None,
        video_tau: float = 0.5,
        mask_sft: MaskSFTSpec | None = None,
    ) -> None:
        if target not in TARGETS:
            raise ValueError(f"--model.target must be one of {sorted(TARGETS)}, got {target!r}")
        if not 0.0 <= caption_frac <= 1.0:
            raise ValueError(f"--model.caption_frac must lie in [0, 1], got {caption_frac}")
        if caption_frac and caption_template not in PROMPT_TEMPLATES:
            raise ValueError(
                f"--model.caption_template {caption_template!r} is not a prompt template; one of {sorted(PROMPT_TEMPLATES)}"
            )
        video_spaces = list(VIDEO_TEMPLATES if video_spaces is None else video_spaces)
        video_templates = dict(VIDEO_TEMPLATES if video_templates is None else video_templates)
        if not video_spaces or not set(video_spaces) <= set(VIDEO_SPACES) or len(set(video_spaces)) < len(video_spaces):
            raise ValueError(f"--model.video_spaces: distinct region spaces of {VIDEO_SPACES}, got {video_spaces}")
        for space in video_spaces:
            if video_templates.get(space) not in PROMPT_TEMPLATES:
                raise ValueError(
                    f"--model.video_templates needs a prompt template for {space!r} (one of {sorted(PROMPT_TEMPLATES)}), "
                    f"got {video_templates}"
                )
        if not video_tau >= 0:
            raise ValueError(f"--model.video_tau is a time gate in seconds and must be >= 0, got {video_tau}")
        self.target, self.prompt_template, self.seed = target, prompt_template, seed
        self.caption_frac, self.caption_template = caption_frac, caption_template
        self.video_spaces, self.video_templates, self.video_tau = video_spaces, video_templates, video_tau
        self.mask_sft = MaskSFT(mask_sft) if mask_sft is not None else None
        self._video_methods: dict[str, CycleGRPO] = {}

    # ------------------------------------------------------------------------------------------------ images
    @property
    def first_template(self) -> str:
        """The first of ``prompt_template``: the template validation asks in."""
        t = self.prompt_template
        return t if isinstance(t, str) else list(t)[0]

    def template_for(self, sample) -> str:
        """The prompt template of ``sample`` (one of ``prompt_template``, fixed by its id)."""
        t = self.prompt_template
        if isinstance(t, str):
            return t
        return list(t)[zlib.crc32(sample.sample_id.encode()) % len(t)]

    def is_caption(self, sample) -> bool:
        """Whether training sample ``sample`` is a captioning sample (``caption_frac``, fixed by its id)."""
        frac = self.caption_frac
        if not hasattr(sample, "clip") and not sample.boxes:  # a no-target image query: no region to caption
            return False  # (a clip's direction is drawn by id whatever its target: `clip_example` checks that)
        return frac > 0 and zlib.crc32(f"{sample.sample_id}/caption".encode()) % 10_000 < frac * 10_000

    def caption_query(self, processor, sample) -> str:
        """The captioning prompt's query: the target's box in the model's input pixels, as the box space writes it
        (what `CycleGRPO` shows its captioning prompt)."""
        in_wh = box_frame_wh(processor, *sample.size)
        return region_space("box").serialize(tuple(rewards.rescale_box(sample.boxes[0], sample.size, in_wh)))

    def target_for(self, sample, input_wh) -> str:
        """``sample``'s completion (`TARGETS`) with boxes in the model's frame ``input_wh``."""
        text = TARGETS[self.target](sample, input_wh, seed=self.seed)
        if self.template_for(sample) == "vlm_r1":  # VLM-R1's format: reasoning and answer only
            text = re.sub(r"<diversity>.*?</diversity>|<description>.*?</description>", "", text, flags=re.S)
        return text

    # ------------------------------------------------------------------------------------------------ clips
    def video_method(self, space: str) -> CycleGRPO:
        """CycleGRPO in region space ``space``, as ``configs/cycle_tiny_{temporal,st}.yaml`` build it: the source of
        the clips' prompts and region texts, so what this stage teaches is what the RL run asks."""
        if space not in self._video_methods:
            method = CycleGRPO(region_space=space, caption_template=self.caption_template, tau=self.video_tau)
            self._video_methods[space] = method.bind(MethodContext(prompt_template=self.video_templates[space]))
        return self._video_methods[space]

    def space_for(self, clip) -> str:
        """The region space training clip ``clip`` is taught in (one of ``video_spaces``, fixed by its id)."""
        spaces = self.video_spaces
        return spaces[zlib.crc32(f"{clip.sample_id}/space".encode()) % len(spaces)]

    def clip_example(self, processor, clip) -> tuple[str, str]:
        """(prompt, target) of a training clip, both from `video_method`: a captioning sample (``is_caption``, and
        its query has a target) shows the region serialized in the model's frame under ``caption_template`` and
        answers the query, which singles the moment out among the actor's other moves; a grounding sample shows the
        query under the space's ``video_templates`` prompt and answers the region as that space writes it, ``no
        target`` (``NO_TARGET``) when the query has none. Answers alone in answer tags: the video path reads only
        the answer (docs/decisions.md)."""
        regions = self.video_method(self.space_for(clip)).regions
        if clip.intervals and self.is_caption(clip):
            return regions.caption_prompt(processor, clip), f"<answer>{clip.query}</answer>"
        prompt = regions.grounding_prompt(processor, clip.query, self.video_templates[regions.space.name])
        return prompt, f"<answer>{regions.region_text(processor, clip)}</answer>"

    # ------------------------------------------------------------------------------------------------ batches
    def encode(self, processor, batch) -> dict[str, torch.Tensor]:
        """Processor inputs for prompt + target, with ``labels`` = -100 everywhere but the target tokens.

        The images (or clips: a batch holds one kind) go through the processor once (with the prompts); each target
        is tokenised on its own and appended to its prompt's tokens, as a rollout appends sampled tokens to the
        prompt, and the rows are left-padded again.
        """
        proc = processor
        tok = proc.tokenizer
        clips = [hasattr(s, "clip") for s in batch]
        if any(clips) and not all(clips):
            raise ValueError(
                "an SFT batch holds images or clips, not both (one processor call, one forward): "
                "datamodules.video.ImageVideoSFTDataModule makes each batch all images or all clips"
            )
        if batch and self.mask_sft is not None and not any(clips):  # mask-token co-SFT (methods/cycle_masks.py)
            pairs = [self.mask_sft.example(proc, s) for s in batch]
            p_enc = proc(text=[p[0] for p in pairs], images=[s.image for s in batch], return_tensors="pt", padding=True)
            targets = [p[1] + "<|im_end|>" for p in pairs]
        elif batch and all(hasattr(s, "completion") for s in batch):  # toy math pairs (datamodules.sft_math)
            p_enc = proc(text=[pair_prompt(proc, s) for s in batch], images=[s.image for s in batch],
                         return_tensors="pt", padding=True)  # fmt: skip
            targets = [s.completion + "<|im_end|>" for s in batch]
        elif batch and all(clips):
            pairs = [self.clip_example(proc, s) for s in batch]
            p_enc = processor_inputs(proc, [p for p, _ in pairs], [s.clip for s in batch])
            targets = [t + "<|im_end|>" for _, t in pairs]
        else:
            captions = [self.is_caption(s) for s in batch]
            prompts = [
                build_prompt_text(proc, self.caption_query(proc, s), task="rec", template=self.caption_template)
                if c
                else build_prompt_text(proc, s.query, task=s.task, template=self.template_for(s))
                for s, c in zip(batch, captions)
            ]
            p_enc = proc(text=prompts, images=[s.image for s in batch], return_tensors="pt", padding=True)
            in_wh = model_input_size(p_enc["image_grid_thw"], getattr(proc.image_processor, "patch_size", 14))
            if side := box_frame(proc):  # targets on the model's relative grid (Qwen3-VL)
                in_wh = [(side, side)] * len(in_wh)
            targets = [
                (f"<answer>{s.query}</answer>" if c else self.target_for(s, wh)) + "<|im_end|>"
                for s, wh, c in zip(batch, in_wh, captions)
            ]
        return _with_targets(tok, p_enc, targets)


def _with_targets(tok, p_enc, targets: list[str]) -> dict[str, torch.Tensor]:
    """The processor's prompt encoding ``p_enc`` with each row's target tokens appended, left-padded again; ``labels``
    are the target tokens, -100 elsewhere."""
    t_ids = [torch.tensor(t, dtype=torch.long) for t in tok(targets, add_special_tokens=False)["input_ids"]]
    keep = p_enc["attention_mask"].bool()
    lengths = [int(keep[i].sum()) + len(t) for i, t in enumerate(t_ids)]
    B, T = len(t_ids), max(lengths)
    enc = {
        "input_ids": torch.full((B, T), tok.pad_token_id, dtype=torch.long),
        "attention_mask": torch.zeros((B, T), dtype=torch.long),
        "labels": torch.full((B, T), -100, dtype=torch.long),
    }
    # the visual inputs as the processor gave them: pixel_values + image_grid_thw, or pixel_values_videos +
    # video_grid_thw + second_per_grid_ts (the seconds per temporal patch of temporal mRoPE)
    enc.update({k: v for k, v in p_enc.items() if k not in ("input_ids", "attention_mask", "mm_token_type_ids")})
    types = p_enc.get("mm_token_type_ids")  # 1 on image tokens, 2 on video tokens (transformers 5.x)
    if types is not None:
        enc["mm_token_type_ids"] = torch.zeros((B, T), dtype=torch.long)
    for i, (t, n) in enumerate(zip(t_ids, lengths)):  # left padding: every target ends its row
        enc["input_ids"][i, T - n :] = torch.cat([p_enc["input_ids"][i][keep[i]], t])
        enc["attention_mask"][i, T - n :] = 1
        enc["labels"][i, T - len(t) :] = t
        if types is not None:
            enc["mm_token_type_ids"][i, T - n : T - len(t)] = types[i][keep[i]]
    return enc
