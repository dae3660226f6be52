"""The ``fast`` rollout engine: one prefill per prompt, static KV cache, CUDA-graph decode (``rollout.fast_generate``)."""

from __future__ import annotations

from collections import OrderedDict

import torch

from lightning_modules.engines.base import RolloutEngine, Sampling, register_rollout_engine
from lightning_modules.qwen_vl import image_embeddings, model_parts, processor_inputs


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


def vision_version(model) -> tuple[int, ...]:
    """A key that changes whenever the vision tower's weights do: the in-place version counters of its parameters
    (an optimizer step, ``load_state_dict`` and ``copy_`` all bump them)."""
    return tuple(p._version for p in model_parts(model).visual.parameters())


class VisionCache:
    """Merged vision features per image (or clip) object, so that every generation of a step that shows the same
    image reuses one run of the vision tower: CycleGRPO's captions and their groundings (1 + N requests per sample)
    encode the sample's image once. Keyed by the object's identity (the cache holds a reference, so an identity is
    never reused while cached) and its grid; dropped when the vision weights change (`vision_version`, and the
    engine's ``on_weights_updated``); at most ``capacity`` entries (least recently used out). An image object is
    treated as immutable: code that edits pixels makes a new image (as the data pool and the edits do)."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[tuple[int, tuple[int, ...]], tuple[object, torch.Tensor]] = OrderedDict()
        self.version: tuple[int, ...] | None = None
        self.encoded = 0
        """Images run through the vision tower so far (for the reuse bench)."""

    def clear(self) -> None:
        self.entries.clear()
        self.version = None

    def features(self, model, images: list, pixel_values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """The features of ``images`` in order, as `qwen_vl.image_embeddings` would compute them for the whole
        batch; only images not cached run through the vision tower (once each, however often they repeat)."""
        version = vision_version(model)
        if version != self.version:
            self.entries.clear()
            self.version = version
        patches = grid.prod(dim=-1).tolist()
        offsets = [0]
        for n in patches:
            offsets.append(offsets[-1] + n)
        keys = [(id(im), tuple(grid[i].tolist())) for i, im in enumerate(images)]
        first: dict[tuple[int, tuple[int, ...]], int] = {}
        for i, k in enumerate(keys):
            if k not in self.entries:
                first.setdefault(k, i)  # an image repeated in the batch runs once
        todo = sorted(first.values())
        if todo:
            if len(todo) == len(keys):  # every image new and distinct (a GRPO step): the batch as it is, no copy
                pix, grid_todo = pixel_values, grid
            else:
                pix = torch.cat([pixel_values[offsets[i] : offsets[i + 1]] for i in todo])
                grid_todo = grid[todo]
            feats = image_embeddings(model, pix, grid_todo)
            merge = sum(patches[i] for i in todo) // feats.shape[0]  # patches per merged token (spatial merge ** 2)
            start = 0
            for i in todo:
                n = patches[i] // merge
                self.entries[keys[i]] = (images[i], feats[start : start + n])
                start += n
            self.encoded += len(todo)
        for k in keys:
            self.entries.move_to_end(k)
        out = torch.cat([self.entries[k][1] for k in keys])
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
        return out


@register_rollout_engine("fast")
class FastRolloutEngine(RolloutEngine):
    """The B prompts are encoded once; their KV caches are copied into the G rows of each group (Qwen2.5-VL; images
    or video clips). Each image object runs through the vision tower once while the vision weights stay the same
    (`VisionCache`), across requests and calls."""

    own_kernels = True

    def __init__(self, compile_step: bool = False) -> None:
        super().__init__(compile_step)
        self.vision = VisionCache()

    def on_weights_updated(self, model) -> None:
        self.vision.clear()

    def sample(self, model, processor, prompts, images, *, group_size, sampling: Sampling, suppress_ids, eos_ids):
        from lightning_modules.rollout import fast_generate

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
