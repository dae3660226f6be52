"""A video input as every layer sees it: a clip of frames at a known frame rate (`VideoClip`), and the keyword
arguments that feed clips to a Qwen-VL processor at their true frame rate and native size (`video_processor_kwargs`).
The data modules build clips and their processor arguments; the rollout engines and the model helpers
(``lightning_modules/models/qwen_vl.py``) take them. Moved from ``lightning_modules/qwen_vl.py``, unchanged."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from PIL import Image

__all__ = [
    "TIMESTAMPED_PROCESSORS",
    "VideoClip",
    "clip_pixel_budget",
    "timestamped_processor",
    "video_processor_kwargs",
]


@dataclass
class VideoClip:
    """A video input: its frames (RGB PIL images, all one size, already sampled: every frame is fed) and their rate.
    ``fps`` sets the seconds per temporal patch the processor reports (``second_per_grid_ts``), hence temporal mRoPE.
    Not frozen: Lightning's batch transfer refuses frozen dataclasses inside a batch."""

    frames: Sequence[Image.Image]
    fps: float

    def __post_init__(self) -> None:
        if len(self.frames) < 2 or len(self.frames) % 2:
            raise ValueError(
                f"a VideoClip needs an even number (>= 2) of frames (Qwen2.5-VL's temporal patches hold 2), got "
                f"{len(self.frames)}: drop or repeat the last frame"
            )
        if not self.fps > 0:
            raise ValueError(f"VideoClip.fps must be > 0, got {self.fps}")

    @property
    def size(self) -> tuple[int, int]:
        return self.frames[0].size


TIMESTAMPED_PROCESSORS = ("Qwen3VLProcessor",)
"""Processors that write a clip's time as text before each temporal patch's block (giving no ``second_per_grid_ts``)
and whose video processor budgets a whole clip's pixels (frames x height x width), not one frame's."""


def timestamped_processor(processor) -> bool:
    """Whether ``processor`` (or a subclass) is one of `TIMESTAMPED_PROCESSORS` (Qwen3-VL's)."""
    return any(c.__name__ in TIMESTAMPED_PROCESSORS for c in type(processor).__mro__)


def clip_pixel_budget(clips: Sequence[VideoClip], factor: int, temporal: int) -> dict[str, int]:
    """The ``size`` of a whole-clip pixel budget (Qwen3-VL's video processor: frames x height x width) under which
    every clip of ``clips`` keeps its size rounded to the ``factor``-pixel grid (patch x merge) and its frame count
    rounded to the ``temporal`` patch: the range of those products over the clips."""

    def pixels(c: VideoClip) -> int:
        w, h = c.size
        rounded = max(factor, round(h / factor) * factor) * max(factor, round(w / factor) * factor)
        return round(len(c.frames) / temporal) * temporal * rounded

    counts = [pixels(c) for c in clips]
    return {"shortest_edge": min(counts), "longest_edge": max(counts)}


def video_processor_kwargs(clips: Sequence[VideoClip], processor=None) -> dict:
    """Keyword arguments of a Qwen-VL processor call that feed ``clips`` as videos at their true frame rate:

    - ``video_metadata`` carries each clip's fps (without it transformers assumes 24 fps, and ``second_per_grid_ts``
      (Qwen2.5-VL) or the timestamps written before each temporal patch (Qwen3-VL) are those of 24 fps);
    - ``do_sample_frames=False``: the clips are already sampled, every frame is kept;
    - ``size``: the processor's pixel budget pinned so that frames keep their native size (rounded to the patch grid)
      instead of being scaled to the default budget (>= 100,352 pixels would upscale a 112 x 112 toy frame to
      ~316 x 316, 8x the tokens). Qwen2-VL / Qwen2.5-VL budget one frame: the largest clip's frame area. Qwen3-VL's
      video processor (given ``processor``) budgets a whole clip, frames x area: pinned to the range of the batch's
      clips, each of which then keeps its rounded size (and ``cap_pixels_per_frame=False``, which would shrink them).
    """
    area = max(c.size[0] * c.size[1] for c in clips)
    size = {"shortest_edge": area, "longest_edge": area}
    extra = {}
    if timestamped_processor(processor):  # the budget covers frames x height x width
        vp = processor.video_processor
        size = clip_pixel_budget(clips, vp.patch_size * vp.merge_size, vp.temporal_patch_size)
        if hasattr(vp, "cap_pixels_per_frame"):  # transformers >= 5.2x: a per-frame cap that would shrink them
            extra["cap_pixels_per_frame"] = False
    return {
        "videos": [list(c.frames) for c in clips],
        "video_metadata": [
            {"fps": float(c.fps), "total_num_frames": len(c.frames), "frames_indices": list(range(len(c.frames)))}
            for c in clips
        ],
        "do_sample_frames": False,
        "size": size,
        **extra,
    }
