"""The Qwen-VL pieces every fast path shares: the model's parts, its 3-D mRoPE positions, rotary helpers and the
vision tower's merged features (with Qwen3-VL's DeepStack features beside them). One copy, used by the rollout engine
(``engines/decode.py``), the packed update engine (``engines/packing.py``) and the batched vision attention; the
processor call for a batch of images or video clips (``processor_inputs``), which every rollout engine uses; and the
frame a model writes its boxes in (`box_frame_wh`: the resized input, or Qwen3-VL's relative grid).

Video: a clip is a list of frames at a known frame rate (`VideoClip`). The processor turns it into
``pixel_values_videos``, ``video_grid_thw`` (t = frames / 2 temporal patches) and ``second_per_grid_ts`` (seconds per
temporal patch). Two layouts (`mrope_positions`):

- Qwen2.5-VL: one run of ``<|video_pad|>`` tokens per clip; temporal mRoPE spaces the t axis of its tokens by
  ``tokens_per_second * second_per_grid_t``.
- Qwen3-VL (`timestamped_frames`): the processor writes each temporal patch as its own block after its timestamp in
  text (``<0.2 seconds><|vision_start|><|video_pad|>...<|vision_end|>``) and gives no ``second_per_grid_ts``; each
  block is placed like an image (t position at the block's start). `processor_inputs` adds the key itself (the clip's
  true seconds per temporal patch), so one key marks a clip on every path; `model_inputs` drops it before the model's
  own code, which does not take it.

Qwen2-VL's processor gives neither seconds nor timestamps (a t axis of one position per patch): refused.

The fast paths keep one kind of visual input per batch (all images or all clips).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from PIL import Image

from core.video import VideoClip, timestamped_processor, video_processor_kwargs

__all__ = [
    "ModelParts",
    "model_parts",
    "model_inputs",
    "mrope_positions",
    "processor_inputs",
    "rotate_half",
    "image_embeddings",
    "split_visual_features",
    "add_deepstack",
    "box_frame",
    "box_frame_wh",
    "model_input_size",
    "model_input_wh",
    "timestamped_frames",
    "video_input_wh",
    "visual_token_id",
]


def model_input_wh(image_processor, width: int, height: int) -> tuple[int, int]:
    """The (width, height) a Qwen2-VL-family image processor resizes a ``width x height`` image to (its ``smart_resize``
    rule: sides multiples of patch x merge, pixel count within the processor's bounds), without processing an image:
    what a prompt that writes coordinates in the model's frame needs before the rollout encodes the image."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    size = image_processor.size
    bound = (lambda k: size.get(k)) if isinstance(size, dict) else (lambda k: getattr(size, k, None))
    lo = bound("shortest_edge") or getattr(image_processor, "min_pixels", None)
    hi = bound("longest_edge") or getattr(image_processor, "max_pixels", None)
    if lo is None or hi is None:
        raise ValueError(
            f"{type(image_processor).__name__} has no pixel bounds (size.shortest_edge / longest_edge or min_pixels / "
            "max_pixels): not a Qwen2-VL-family image processor; give the model's own processor"
        )
    h, w = smart_resize(
        height, width, factor=image_processor.patch_size * image_processor.merge_size, min_pixels=lo, max_pixels=hi
    )
    return w, h


RELATIVE_BOX_FRAMES = {"Qwen3VLProcessor": 1000}
"""Processors whose models read and write boxes in relative coordinates on a ``side x side`` grid (Qwen3-VL: 0-1000,
QwenLM/Qwen3-VL#1741); every other Qwen-VL model writes pixels of its resized input (Qwen2-VL, Qwen2.5-VL)."""


def box_frame(processor) -> int | None:
    """The side of the relative grid ``processor``'s model writes boxes on (1000 for Qwen3-VL), or None when it
    writes pixels of the resized model input."""
    return RELATIVE_BOX_FRAMES.get(type(processor).__name__)


def box_frame_wh(processor, width: int, height: int) -> tuple[int, int]:
    """The (width, height) of the frame the model's box coordinates live in for a ``width x height`` image: the
    resized input (``model_input_wh``) or the relative grid. ``rewards.rescale_box(b, box_frame_wh(...), (width,
    height))`` maps a written box to original pixels, and the reverse maps a box into a prompt."""
    side = box_frame(processor)
    return (side, side) if side else model_input_wh(processor.image_processor, width, height)


def model_input_size(image_grid_thw: torch.Tensor, patch_size: int = 14) -> list[tuple[int, int]]:
    """(width, height) in pixels of each resized model input, from ``image_grid_thw`` [N, 3] (t, h, w patches)."""
    return [(int(w) * patch_size, int(h) * patch_size) for _, h, w in image_grid_thw.tolist()]


def video_input_wh(processor, clip: VideoClip) -> tuple[int, int]:
    """The (width, height) of ``clip``'s frames as the model sees them under `video_processor_kwargs` (the
    processor's resize rule at the clip's own pixel budget): the frame a prompt's coordinates are written in; the
    relative grid for a model of relative coordinates (`box_frame`)."""
    from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize

    if side := box_frame(processor):
        return side, side
    vp = processor.video_processor
    w, h = clip.size
    h2, w2 = smart_resize(h, w, factor=vp.patch_size * vp.merge_size, min_pixels=w * h, max_pixels=w * h)
    return w2, h2


def processor_inputs(processor, prompts: Sequence[str], visuals: Sequence[Image.Image | VideoClip]):
    """``processor(text=prompts, images=... | videos=..., return_tensors="pt", padding=True)`` for one visual per
    prompt: all images or all `VideoClip`s (one kind per batch, as the fast paths assume). A batch of clips always
    carries ``second_per_grid_ts``: Qwen3-VL's processor gives none (its timestamps are text), so it is added, each
    clip's temporal patch over its fps; `model_inputs` drops it again before the model's own code."""
    videos = [isinstance(v, VideoClip) for v in visuals]
    if any(videos) and not all(videos):
        raise ValueError("one rollout batch holds images or video clips, not both: make one generate() call per kind")
    if visuals and all(videos):
        enc = processor(
            text=list(prompts), return_tensors="pt", padding=True, **video_processor_kwargs(visuals, processor)
        )
        if enc.get("second_per_grid_ts") is None:
            if not timestamped_processor(processor):
                raise ValueError(
                    f"video clips through {type(processor).__name__}: it gives no second_per_grid_ts and does not "
                    "write timestamps (Qwen2-VL: a t axis of one position per temporal patch), a layout the "
                    "project's rollout and update paths do not implement: set --model.init_args.policy.model_name_or_path "
                    "to a Qwen2.5-VL or Qwen3-VL checkpoint for video configs, or use images with this model"
                )
            # Qwen3-VL: the time is in the text; the project's key marks the batch as clips (`model_inputs` drops it)
            t = getattr(processor.video_processor, "temporal_patch_size", 2)
            enc["second_per_grid_ts"] = torch.tensor([t / float(c.fps) for c in visuals], dtype=torch.float32)
        return enc
    return processor(text=list(prompts), images=list(visuals), return_tensors="pt", padding=True)


def visual_token_id(config, video: bool) -> int:
    """The placeholder token the vision features replace: ``<|video_pad|>`` for clips, ``<|image_pad|>`` for images."""
    return config.video_token_id if video else config.image_token_id


TIMESTAMPED_FRAME_TYPES = ("qwen3_vl",)
"""``config.model_type`` of the models whose processor writes a clip as one block of ``<|video_pad|>`` tokens per
temporal patch, each after its timestamp in text, and whose positions place each block like an image
(`timestamped_frames`)."""


def timestamped_frames(config) -> bool:
    """Whether ``config``'s model (Qwen3-VL) reads a clip as timestamped blocks, one per temporal patch, instead of one
    run of tokens on a t axis spaced by ``second_per_grid_ts`` (Qwen2.5-VL)."""
    return getattr(config, "model_type", None) in TIMESTAMPED_FRAME_TYPES


def model_inputs(model, inputs: dict) -> dict:
    """``inputs`` for the model's own forward / ``generate``: without the ``second_per_grid_ts`` that
    `processor_inputs` adds for a model that does not take it (Qwen3-VL's ``generate`` refuses unknown keys)."""
    config = getattr(model, "config", None)
    if "second_per_grid_ts" in inputs and timestamped_frames(config):
        return {k: v for k, v in inputs.items() if k != "second_per_grid_ts"}
    return inputs


# --------------------------------------------------------------------------------------------------------------------
# Model parts (works for Qwen2_5_VLForConditionalGeneration of transformers 5.x; wrappers expose `.module`)
# --------------------------------------------------------------------------------------------------------------------


FAST_MODEL_TYPES = ("qwen2_vl", "qwen2_5_vl", "qwen3_vl")
"""``config.model_type`` of the models the fast / packed engines (and the fast vision attention) implement. Qwen3-VL
differs from Qwen2.5-VL in three places these paths handle: per-head RMSNorm of queries and keys (``q_norm`` /
``k_norm``, applied in `decode._qkv` when the attention has them), interleaved mRoPE sections (inside the model's own
``rotary_emb``, which the paths call with the same 3-D positions) and DeepStack (`image_embeddings`,
`add_deepstack`)."""


@dataclass(frozen=True)
class ModelParts:
    """The pieces of a Qwen-VL model that the fast paths use."""

    visual: torch.nn.Module  # vision tower (patch embed, blocks, merger; Qwen3-VL: DeepStack mergers)
    text: torch.nn.Module  # the text model: embed_tokens, layers, norm, rotary_emb
    lm_head: torch.nn.Module
    config: object  # the top-level Qwen2_5_VLConfig / Qwen3VLConfig


def model_parts(model: torch.nn.Module) -> ModelParts:
    """Find the vision tower, the text model and the LM head of a Qwen-VL model (or a wrapper holding one)."""
    m = model
    for _ in range(4):  # unwrap DDP / Lightning / torch.compile wrappers
        if hasattr(m, "lm_head") and hasattr(m, "model"):
            break
        m = getattr(m, "module", None) or getattr(m, "_orig_mod", None) or getattr(m, "base_model", None)
        if m is None:
            raise TypeError(f"fast rollout needs a Qwen-VL ForConditionalGeneration model, got {type(model).__name__}")
    model_type = getattr(m.config, "model_type", None)
    if model_type not in FAST_MODEL_TYPES:
        raise TypeError(
            f"the fast rollout / packed update engines implement Qwen2-VL, Qwen2.5-VL and Qwen3-VL (their mRoPE, "
            f"vision merger and DeepStack), not {model_type!r} ({type(m).__name__}): set --model.engines.rollout_engine "
            "hf_shared (or hf) --model.engines.update_engine hf, which run the model's own transformers code"
        )
    inner = m.model
    text = getattr(inner, "language_model", None)
    if text is None or not hasattr(text, "layers"):
        raise TypeError("fast rollout needs transformers >= 5 (Qwen2_5_VLModel.language_model with .layers)")
    return ModelParts(visual=inner.visual, text=text, lm_head=m.lm_head, config=m.config)


# --------------------------------------------------------------------------------------------------------------------
# 3-D mRoPE positions (Qwen2_5_VLModel.get_rope_index for images, vectorised per row)
# --------------------------------------------------------------------------------------------------------------------


def mrope_positions(
    config,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None,
    image_grid_thw: torch.Tensor | None,
    second_per_grid_ts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """3-D rope positions of left- or right-padded prompts holding images, or videos when ``second_per_grid_ts`` is
    given (then ``image_grid_thw`` holds the videos' ``video_grid_thw``).

    Returns ``positions [3, B, P]`` (padding gets 0, like transformers) and ``next_pos [B]``: the position of the first
    token after the prompt, where ``get_rope_index`` puts a text token that follows it (each text run continues from
    the one before; a visual block advances the text by ``max(h, w) / merge``), i.e. where a full forward of prompt +
    completion, as the update engines and SFT compute it, puts the completion. That is ``max(positions) + 1`` for
    images, but not after a clip whose t axis (``tokens_per_second`` x seconds per patch) runs past its h / w axes:
    transformers' own ``rope_deltas`` (``max + 1 - length``) would then decode at positions its forward never gives a
    completion (a 16-frame clip at 4 tokens per second: 67 instead of 49). Visual inputs are consumed in order from
    the grid; each is one run of its placeholder tokens of length ``t*h*w / merge**2``. A video's t axis advances by
    ``tokens_per_second * second_per_grid_ts[i]`` per temporal patch (truncated, as transformers' ``get_rope_index``),
    an image's by 1. A Qwen3-VL clip (`timestamped_frames`) is ``t`` runs of ``h*w / merge**2`` tokens, one per
    temporal patch with its timestamp text between them, each placed as an image of grid ``1 x h x w`` (as its
    ``get_rope_index`` splits ``video_grid_thw``); ``second_per_grid_ts`` then only marks the inputs as clips.
    """
    video = second_per_grid_ts is not None
    image_token_id = visual_token_id(config, video)
    tokens_per_second = getattr(config.vision_config, "tokens_per_second", 1)
    merge = config.vision_config.spatial_merge_size
    B, P = input_ids.shape
    device = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    positions = torch.zeros(3, B, P, dtype=torch.long, device=device)
    next_pos = torch.zeros(B, dtype=torch.long, device=device)
    grids = image_grid_thw.tolist() if image_grid_thw is not None else []
    # each visual block in order: its grid and its t step (images 1; a clip's seconds per patch x tokens per second)
    if video and timestamped_frames(config):  # Qwen3-VL: one image-like block per temporal patch
        blocks = [((1, h, w), 1) for t, h, w in grids for _ in range(int(t))]
    elif video:
        seconds = second_per_grid_ts.cpu().tolist()  # one copy, not a device sync per video
        blocks = [(g, tokens_per_second * seconds[i]) for i, g in enumerate(grids)]
    else:
        blocks = [(g, 1) for g in grids]
    ids_cpu = input_ids.cpu()
    mask_cpu = attention_mask.cpu().bool()
    img = 0
    for b in range(B):
        ids = ids_cpu[b][mask_cpu[b]]
        is_img = (ids == image_token_id).tolist()
        n = len(is_img)
        pos = torch.zeros(3, n, dtype=torch.long)
        cur = 0
        i = 0
        while i < n:
            if not is_img[i]:
                j = i
                while j < n and not is_img[j]:
                    j += 1
                pos[:, i:j] = torch.arange(cur, cur + j - i)
                cur += j - i
                i = j
            else:
                if img >= len(blocks):
                    raise ValueError("more image-token runs in input_ids than rows in image_grid_thw")
                grid, interval = blocks[img]
                t, h, w = (int(x) for x in grid)
                img += 1
                gh, gw = h // merge, w // merge
                count = t * gh * gw
                tt = (torch.arange(t) * interval).long().view(t, 1, 1).expand(t, gh, gw).reshape(-1)
                hh = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw).reshape(-1)
                ww = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw).reshape(-1)
                if i + count > n or not all(is_img[i : i + count]):
                    kind, token = ("video", "<|video_pad|>") if video else ("image", "<|image_pad|>")
                    raise ValueError(f"{kind} {img - 1}: expected {count} {token} tokens in a run (grid {t}x{h}x{w})")
                pos[0, i : i + count] = tt + cur
                pos[1, i : i + count] = hh + cur
                pos[2, i : i + count] = ww + cur
                cur += max(gh, gw)
                i += count
        positions[:, b, mask_cpu[b].to(device)] = pos.to(device)
        next_pos[b] = cur  # the next text token's position (not max + 1: see the docstring)
    return positions, next_pos


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the last dimension: ``(x1, x2) -> (-x2, x1)`` (rotary embeddings)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def image_embeddings(model, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
    """Vision features of all images (or clips), in order, one row per merged token (grad flows if enabled).

    Qwen2-VL / Qwen2.5-VL: the merged features ``[n, hidden]``. Qwen3-VL: the merged features and then each DeepStack
    layer's, side by side, ``[n, hidden * (1 + DeepStack layers)]``, so that every gather, split and cache over tokens
    (the G rows of a group, the vision cache, the packed engine's micro-batches) carries them together;
    `split_visual_features` takes them apart where they enter the decoder."""
    visual = model_parts(model).visual
    out = visual(
        pixel_values.to(visual.dtype if hasattr(visual, "dtype") else pixel_values.dtype), grid_thw=image_grid_thw
    )
    merged = out.pooler_output if hasattr(out, "pooler_output") else out
    deep = getattr(out, "deepstack_features", None)
    return torch.cat([merged, *deep], dim=-1) if deep else merged


def split_visual_features(feats: torch.Tensor, hidden: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """`image_embeddings`' rows -> (merged features [n, hidden], one [n, hidden] tensor per DeepStack layer)."""
    merged, *deep = feats.split(hidden, dim=-1)
    return merged, deep


def add_deepstack(h: torch.Tensor, visual_mask: torch.Tensor, feats: torch.Tensor) -> torch.Tensor:
    """DeepStack: add one vision layer's features to the hidden states of the visual tokens (``visual_mask`` [B, S])
    after a decoder layer, as Qwen3-VL's text model does; out of place, so autograd and checkpointing see it."""
    return h.masked_scatter(visual_mask[..., None], h[visual_mask] + feats.to(h.dtype))
