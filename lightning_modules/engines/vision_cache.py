"""Vision features kept per image (or clip) object while the vision weights stay the same, for rollout engines.

Every generation of a step that shows the same image can reuse one run of the vision tower: a GRPO group's G rows,
and CycleGRPO's captions and all their groundings (1 + N requests per sample). Two engines use it:

* ``fast`` asks for the merged features it scatters itself (`VisionCache.features`);
* ``hf_shared`` serves the model's own vision tower from the cache for the length of its prefill forward
  (`VisionCache.serving`): whatever transformers calls the tower with (Qwen2.5-VL's merged features, Qwen3-VL's
  DeepStack features besides them), every field is kept per image and put back together in the batch's order, so the
  model code above the tower runs unchanged.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from lightning_modules.models.qwen_vl import image_embeddings, model_parts

__all__ = ["VisionCache", "vision_tower", "vision_version"]


def vision_tower(model) -> torch.nn.Module:
    """The vision tower of a transformers Qwen-VL model (Qwen2-VL, Qwen2.5-VL, Qwen3-VL) or a wrapper holding one."""
    m = model
    for _ in range(4):  # DDP / Lightning / torch.compile / PEFT wrappers
        inner = getattr(m, "model", None)
        if inner is not None and hasattr(inner, "visual"):
            return inner.visual
        m = getattr(m, "module", None) or getattr(m, "_orig_mod", None) or getattr(m, "base_model", None)
        if m is None:
            break
    raise TypeError(f"no vision tower found in {type(model).__name__} (expected .model.visual, as Qwen-VL models have)")


def vision_version(tower: torch.nn.Module) -> tuple[int, ...]:
    """A key that changes whenever the tower's weights do: the in-place version counters of its parameters (an
    optimizer step, ``load_state_dict`` and ``copy_`` all bump them)."""
    return tuple(p._version for p in tower.parameters())


class VisionCache:
    """Vision outputs per image (or clip) object. Keyed by the object's identity (the cache holds a reference, so an
    identity is never reused while cached) and its grid; dropped when the vision weights change (`vision_version`,
    and the engine's ``on_weights_updated``); at most ``capacity`` entries (least recently used out). An image object
    is treated as immutable: code that edits pixels makes a new image (as the data pool and the edits do)."""

    def __init__(self, capacity: int = 64) -> None:
        self.capacity = capacity
        self.entries: OrderedDict[tuple, tuple[object, Any]] = OrderedDict()
        self.version: tuple[int, ...] | None = None
        self.encoded = 0
        """Images run through the vision tower so far (for the reuse bench)."""

    def clear(self) -> None:
        self.entries.clear()
        self.version = None

    def _lookup(
        self,
        tower: torch.nn.Module,
        tag: str,
        images: list,
        pixel_values: torch.Tensor,
        grid: torch.Tensor,
        encode: Callable[[torch.Tensor, torch.Tensor], Any],
        split: Callable[[Any, list[int]], list[Any]],
        join: Callable[[list[Any]], Any],
    ) -> Any:
        """``encode`` (pixels, grid) -> output of a batch of images; ``split`` (output, patches per image) -> one
        piece per image; ``join`` (pieces) -> the output of those images as one batch. Only images not cached are
        encoded (once each, however often they repeat in the batch)."""
        version = vision_version(tower)
        if version != self.version:
            self.entries.clear()
            self.version = version
        patches = grid.prod(dim=-1).tolist()
        offsets = [0]
        for n in patches:
            offsets.append(offsets[-1] + n)
        keys = [(tag, id(im), tuple(grid[i].tolist())) for i, im in enumerate(images)]
        first: dict[tuple, int] = {}
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
            out = encode(pix, grid_todo)
            for i, piece in zip(todo, split(out, [patches[i] for i in todo])):
                self.entries[keys[i]] = (images[i], piece)
            self.encoded += len(todo)
        for k in keys:
            self.entries.move_to_end(k)
        out = join([self.entries[k][1] for k in keys])
        while len(self.entries) > self.capacity:
            self.entries.popitem(last=False)
        return out

    def features(self, model, images: list, pixel_values: torch.Tensor, grid: torch.Tensor) -> torch.Tensor:
        """The merged features of ``images`` in order, as `qwen_vl.image_embeddings` would compute them for the whole
        batch (the ``fast`` engine; Qwen2-VL / Qwen2.5-VL)."""
        parts = model_parts(model)

        def split(feats: torch.Tensor, patches: list[int]) -> list[torch.Tensor]:
            merge = sum(patches) // feats.shape[0]  # patches per merged token (spatial merge ** 2)
            return list(torch.split(feats, [n // merge for n in patches]))

        return self._lookup(
            parts.visual, "merged", images, pixel_values, grid,
            lambda pix, g: image_embeddings(model, pix, g), split, torch.cat,
        )  # fmt: skip

    @contextmanager
    def serving(self, model, images: list) -> Iterator[None]:
        """While inside, calls of ``model``'s vision tower are served per image from the cache: the i-th image of a
        call is ``images[i]`` (the call must hold exactly ``len(images)`` grids, as a processor batch of these
        images does). Any output field that is a tensor (or list of tensors) over the batch's patches or merged
        tokens is kept per image; an output with other fields is passed through uncached. Re-entrant calls (a
        tower calling itself) go straight to the tower."""
        tower = vision_tower(model)
        patched = tower.__dict__.get("forward")  # an instance-level forward already there (kept and restored)
        original = tower.forward
        depth = 0

        def forward(pixel_values, grid_thw=None, *args, **kwargs):
            nonlocal depth
            grid = kwargs.get("grid_thw", grid_thw)
            if depth or args or grid is None or grid.shape[0] != len(images):
                return original(pixel_values, grid_thw, *args, **kwargs)
            depth += 1
            try:
                return self._lookup(
                    tower, "tower", images, pixel_values, grid,
                    lambda pix, g: original(pix, grid_thw=g, **kwargs), _split_output, _join_output,
                )  # fmt: skip
            finally:
                depth -= 1

        tower.forward = forward
        try:
            yield
        finally:
            if patched is None:
                del tower.forward  # back to the class's forward
            else:
                tower.forward = patched


class _Uncacheable(Exception):
    pass


def _split_tensor(t: torch.Tensor, patches: list[int], merged: list[int]) -> list[torch.Tensor]:
    if t.shape[0] == sum(patches):
        return list(torch.split(t, patches))
    if t.shape[0] == sum(merged):
        return list(torch.split(t, merged))
    raise _Uncacheable


def _split_output(out, patches: list[int]) -> list[Any]:
    """One piece per image of a vision tower's output: for each field, the image's rows (its patches, or its merged
    tokens: a quarter of them for Qwen-VL's 2 x 2 merge)."""
    fields = dict(out.items()) if hasattr(out, "items") else {"": out}
    total_merged = None
    for v in fields.values():  # the merged-token count: the pooled output's rows (or the tensor's own)
        if isinstance(v, torch.Tensor) and v.shape[0] != sum(patches):
            total_merged = v.shape[0]
            break
    merge = sum(patches) // total_merged if total_merged else 1
    merged = [n // merge for n in patches]
    pieces: list[dict] = [{} for _ in patches]
    try:
        for name, v in fields.items():
            if isinstance(v, torch.Tensor):
                for piece, part in zip(pieces, _split_tensor(v, patches, merged)):
                    piece[name] = part
            elif isinstance(v, (list, tuple)) and all(isinstance(x, torch.Tensor) for x in v):
                per_layer = [_split_tensor(x, patches, merged) for x in v]
                for i, piece in enumerate(pieces):
                    piece[name] = [layer[i] for layer in per_layer]
            elif v is not None:
                raise _Uncacheable
    except _Uncacheable:
        raise TypeError(
            f"the vision tower returned {type(out).__name__} with fields {list(fields)} that are not per-patch or "
            "per-token tensors: the hf_shared engine cannot cache it; use --model.engines.rollout_engine hf"
        ) from None
    kind = type(out) if hasattr(out, "items") else None
    return [(kind, piece) for piece in pieces]


def _join_output(pieces: list[Any]):
    kind, first = pieces[0]
    fields = {}
    for name, v in first.items():
        if isinstance(v, torch.Tensor):
            fields[name] = torch.cat([p[name] for _, p in pieces])
        else:
            fields[name] = [torch.cat([p[name][j] for _, p in pieces]) for j in range(len(v))]
    return kind(**fields) if kind is not None else fields[""]
