"""The ``fast`` rollout engine: one prefill per prompt, static KV cache, CUDA-graph decode (``decode.fast_generate``)."""

from __future__ import annotations

import torch

from lightning_modules.engines.base import RolloutEngine, Sampling
from lightning_modules.engines.decode import fast_generate, release_rollout_cache
from lightning_modules.engines.vision_cache import VisionCache
from lightning_modules.models.qwen_vl import processor_inputs

__all__ = ["FastRolloutEngine", "VisionCache", "repeat_encoding"]


def repeat_encoding(enc, group_size: int) -> dict[str, torch.Tensor]:
    """Repeat a B-prompt processor output G times per prompt (rows grouped by prompt); images or videos."""
    video = "video_grid_thw" in enc
    pix_key, grid_key = ("pixel_values_videos", "video_grid_thw") if video else ("pixel_values", "image_grid_thw")
    counts = enc[grid_key].prod(dim=-1)
    offsets = torch.cat([counts.new_zeros(1), counts.cumsum(0)]).tolist()
    pixels = [enc[pix_key][offsets[i] : offsets[i + 1]] for i in range(len(counts)) for _ in range(group_size)]
    out = {
        "input_ids": enc["input_ids"].repeat_interleave(group_size, 0),
        "attention_mask": enc["attention_mask"].repeat_interleave(group_size, 0),
        pix_key: torch.cat(pixels),
        grid_key: enc[grid_key].repeat_interleave(group_size, 0),
    }
    for key in ("mm_token_type_ids", "second_per_grid_ts"):
        if key in enc:
            out[key] = enc[key].repeat_interleave(group_size, 0)
    return out


class FastRolloutEngine(RolloutEngine):
    """The B prompts are encoded once; their KV caches are copied into the G rows of each group (Qwen2-VL, Qwen2.5-VL
    and Qwen3-VL; images or video clips). Each image object runs through the vision tower once while the vision
    weights stay the same (`VisionCache`), across requests and calls."""

    own_kernels = True
    fixed_rows = True  # `decode._engine_for`: one decode engine per row count

    def __init__(self, compile_step: bool = False) -> None:
        super().__init__(compile_step)
        self.vision = VisionCache()

    def on_weights_updated(self, model) -> None:
        self.vision.clear()

    def release(self, model) -> None:
        release_rollout_cache(model)  # its CUDA graph points at the parameters being freed

    def sample(self, model, processor, prompts, images, *, group_size, sampling: Sampling, suppress_ids, eos_ids):
        device = next(model.parameters()).device
        enc = processor_inputs(processor, prompts, images).to(device)
        video = "video_grid_thw" in enc
        pixels = enc["pixel_values_videos" if video else "pixel_values"]
        grid = enc["video_grid_thw" if video else "image_grid_thw"]
        cacheable = all(im is not None for im in images) and grid.shape[0] == len(images)
        completion_ids = fast_generate(
            model,
            input_ids=enc["input_ids"],
            attention_mask=enc["attention_mask"],
            pixel_values=pixels,
            image_grid_thw=grid,
            image_embeds=self.vision.features(model, images, pixels, grid) if cacheable else None,
            second_per_grid_ts=enc.get("second_per_grid_ts"),
            group_size=group_size,
            max_new_tokens=sampling.max_new_tokens,
            temperature=0.0 if sampling.greedy else sampling.temperature,
            top_p=sampling.top_p,
            suppress_token_ids=suppress_ids,
            eos_token_ids=eos_ids,
            pad_token_id=processor.tokenizer.pad_token_id,
            min_new_tokens=sampling.min_new_tokens,
            compile_step=self.compile_step,
        )
        return completion_ids, repeat_encoding(enc, group_size)
