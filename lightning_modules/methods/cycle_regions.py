"""CycleGRPO's regions: the space a run writes them in and how a sample's region enters and leaves the model's text.

`CycleRegions` is what CycleGRPO's three parts read the same way: the training step (`methods/cycle_grpo.py`), its
evaluation (`methods/cycle_eval.py`) and its prediction records (`methods/cycle_records.py`), and the video SFT stage
(`SFTModule`), so what the stage teaches is what the RL run asks. Per sample it gives the ground-truth region
(`gt_region`), the region as the captioning prompt shows it (`region_text`, in the frame the model reads: input pixels
or the relative grid, seconds), the captioning and grounding prompts, and the region a grounding answers, in the ground
truth's frame (`predicted_region`: original pixels, seconds; None when unreadable).

Spaces (``--model.method.init_args.region_space``): ``box`` (images), ``mask`` (images, as mask tokens: the
``MaskRegions`` of ``methods/cycle_masks.py`` gives the space, the ground truths and the decoded answers),
``interval`` and ``anchor`` (clips, ``datamodules/video.py``; an interval space is bounded by each clip's duration,
the anchor space's time gate is ``tau``).
"""

from __future__ import annotations

from typing import Any

from core import regions, rewards
from core.regions import NO_TARGET, AnchorSpace, IntervalSpace
from lightning_modules.evaluation.evaluator import answered_region
from lightning_modules.methods.cycle_masks import MaskRegions
from lightning_modules.methods.cycle_rewards import raw_caption
from lightning_modules.models.prompts import build_prompt_text
from lightning_modules.models.qwen_vl import box_frame_wh, video_input_wh

__all__ = ["VIDEO_SPACES", "CycleRegions"]

VIDEO_SPACES = ("interval", "anchor")
"""The region spaces of clips (the other two, ``box`` and ``mask``, are of images)."""


class CycleRegions:
    """The region space of a CycleGRPO run (module docstring), the captioning template and, for ``region_space:
    mask``, the mask tokenizer (`MaskRegions`, else None).

    Args:
        region_space: ``box``, ``mask``, ``interval`` or ``anchor`` (checked by `CycleGRPO`).
        caption_template: the ``PROMPT_TEMPLATES`` key of the caption prompt (its ``{query}`` is the serialized region).
        tau: Eq. 15's time gate, in seconds (the anchor space and its metrics).
        masks: the mask tokenizer and per-sample bound spaces of ``region_space: mask``; None otherwise.
    """

    def __init__(self, region_space: str, caption_template: str, tau: float, masks: MaskRegions | None) -> None:
        self.masks = masks
        self.video = region_space in VIDEO_SPACES
        if masks is not None:
            self.space = masks.space
        else:
            self.space = AnchorSpace(tau=tau) if region_space == "anchor" else regions.region_space(region_space)
        self.caption_template = caption_template
        self.tau = tau

    def check_samples(self, batch) -> None:
        """Raise when the batch's samples are not of the space's kind (clips for a video space, else images)."""
        is_video = [hasattr(s, "clip") for s in batch]
        if any(v != self.video for v in is_video):
            kind = "video samples (datamodules.video.VideoGroundingDataModule)" if self.video else "image samples"
            raise ValueError(
                f"--model.method.init_args.region_space {self.space.name} needs {kind}; the batch holds "
                f"{'video' if any(is_video) else 'image'} samples: set region_space to match the data module"
            )

    # ------------------------------------------------------------------------------------------------ prompts
    def prompt(self, processor, query: str, template: str | None) -> str:
        """The chat prompt of ``query`` under ``template`` (None: the query as it is), with an image or a clip."""
        return build_prompt_text(processor, query, task="rec", template=template, video=self.video)

    def region_text(self, processor, sample) -> str:
        """``sample``'s ground-truth region as the captioning prompt shows it, in the model's frame (input pixels or
        the relative grid, seconds): also the answer a perfect grounding writes (``no target`` when the query has
        none). The video SFT stage (``SFTModule``) teaches exactly this text."""
        if self.masks is not None:
            return self.masks.region_text(sample)
        return self.space.serialize(self.prompt_region(processor, sample))

    def caption_prompt(self, processor, sample) -> str:
        """The captioning prompt of ``sample``: its serialized region under ``caption_template``, with its image or
        clip; a released row's own captioning prompt (``meta["row_caption_question"]``) as it is."""
        own = (getattr(sample, "meta", None) or {}).get("row_caption_question")
        if own is not None:
            return self.prompt(processor, own, None)
        return self.prompt(processor, self.region_text(processor, sample), self.caption_template)

    def own_prompt(self, processor, sample, template: str) -> str:
        """The grounding prompt of a sample asked from its own query (no target): a released row's own question
        (``meta["row_question"]``) as it is, as the repository asks it; else its query under ``template``."""
        own = (getattr(sample, "meta", None) or {}).get("row_question")
        return self.prompt(processor, sample.query, template) if own is None else self.prompt(processor, own, None)

    def grounding_prompt(self, processor, caption: str, template: str) -> str:
        """The grounding prompt of a (stripped) caption under ``template`` (the module's ``prompt_template``)."""
        return self.prompt(processor, caption, template)

    # ------------------------------------------------------------------------------------------------ regions
    def space_for(self, sample):
        """The region space that scores ``sample`` (intervals are bounded by the sample's clip; masks: bound to its
        image)."""
        if self.masks is not None:
            return self.masks.bound(sample)
        return self.space.with_duration(sample.duration) if isinstance(self.space, IntervalSpace) else self.space

    def gt_region(self, sample) -> Any:
        """The sample's ground-truth region: its clip's region in the space, its first box; ``NO_TARGET`` when its
        query has none."""
        if self.video:
            return sample.region(self.space.name)
        if self.masks is not None:
            return self.masks.gt(sample)
        return sample.boxes[0] if len(sample.boxes) else NO_TARGET

    def prompt_region(self, processor, sample) -> Any:
        """The region as the captioning prompt shows it, in the frame the model reads and writes (pixels of the
        model input, seconds), computed without encoding."""
        if not self.video:
            return rewards.rescale_box(sample.boxes[0], sample.size, box_frame_wh(processor, *sample.size))
        region = self.gt_region(sample)
        if self.space.name == "anchor" and region is not NO_TARGET:
            wh = video_input_wh(processor, sample.clip)
            region = tuple((t, tuple(rewards.rescale_box(list(b), sample.size, wh))) for t, b in region)
        return region

    def predicted_region(self, sample, text: str, input_wh, parsed: rewards.ParsedCompletion | None = None) -> Any:
        """The region a grounding completion ``text`` answers, in the ground truth's frame (original pixels,
        seconds); None when unreadable. ``parsed``: ``text`` already parsed (`rewards.parse_completion`), if at hand."""
        if self.masks is not None:
            return self.masks.predicted(sample, text)
        if self.video:
            pred = self.space.parse(raw_caption(text))  # the answer part when there is one
            if self.space.name == "anchor" and pred is not None and pred is not NO_TARGET:
                pred = tuple((t, tuple(rewards.rescale_box(list(b), input_wh, sample.size))) for t, b in pred)
            return pred
        return answered_region(text, parsed or rewards.parse_completion(text), input_wh, sample.size, self.space)
