"""The Qwen2.5-VL pieces every fast path shares: the model's parts, its 3-D mRoPE positions, rotary helpers and the
vision tower's merged features. One copy, used by the rollout engine (``rollout.py``), the packed update engine
(``efficient.py``) and the batched vision attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["ModelParts", "model_parts", "mrope_positions", "rotate_half", "image_embeddings"]


# --------------------------------------------------------------------------------------------------------------------
# Model parts (works for Qwen2_5_VLForConditionalGeneration of transformers 5.x; wrappers expose `.module`)
# --------------------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelParts:
    """The pieces of a Qwen2.5-VL model that the fast paths use."""

    visual: torch.nn.Module  # vision tower (patch embed, blocks, merger)
    text: torch.nn.Module  # Qwen2_5_VLTextModel: embed_tokens, layers, norm, rotary_emb
    lm_head: torch.nn.Module
    config: object  # the top-level Qwen2_5_VLConfig


def model_parts(model: torch.nn.Module) -> ModelParts:
    """Find the vision tower, the text model and the LM head of a Qwen2.5-VL model (or a wrapper holding one)."""
    m = model
    for _ in range(4):  # unwrap DDP / Lightning / torch.compile wrappers
        if hasattr(m, "lm_head") and hasattr(m, "model"):
            break
        m = getattr(m, "module", None) or getattr(m, "_orig_mod", None) or getattr(m, "base_model", None)
        if m is None:
            raise TypeError(f"fast rollout needs a Qwen2_5_VLForConditionalGeneration, got {type(model).__name__}")
    inner = m.model
    text = getattr(inner, "language_model", None)
    if text is None or not hasattr(text, "layers"):
        raise TypeError("fast rollout needs transformers >= 5 (Qwen2_5_VLModel.language_model with .layers)")
    return ModelParts(visual=inner.visual, text=text, lm_head=m.lm_head, config=m.config)


# --------------------------------------------------------------------------------------------------------------------
# 3-D mRoPE positions (Qwen2_5_VLModel.get_rope_index for images, vectorised per row)
# --------------------------------------------------------------------------------------------------------------------


def mrope_positions(
    config, input_ids: torch.Tensor, attention_mask: torch.Tensor | None, image_grid_thw: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """3-D rope positions of left- or right-padded prompts holding images (no videos).

    Returns ``positions [3, B, P]`` (padding gets 0, like transformers) and ``next_pos [B]``: the position of the first
    token after the prompt, ``max(positions of row b) + 1``. Images are consumed in order from ``image_grid_thw``;
    each image is one run of ``image_token_id`` tokens of length ``t*h*w / merge**2``.
    """
    image_token_id = config.image_token_id
    merge = config.vision_config.spatial_merge_size
    B, P = input_ids.shape
    device = input_ids.device
    if attention_mask is None:
        attention_mask = torch.ones_like(input_ids)
    positions = torch.zeros(3, B, P, dtype=torch.long, device=device)
    next_pos = torch.zeros(B, dtype=torch.long, device=device)
    grids = image_grid_thw.tolist() if image_grid_thw is not None else []
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
                if img >= len(grids):
                    raise ValueError("more image-token runs in input_ids than rows in image_grid_thw")
                t, h, w = (int(x) for x in grids[img])
                img += 1
                gh, gw = h // merge, w // merge
                count = t * gh * gw
                tt = torch.arange(t).view(t, 1, 1).expand(t, gh, gw).reshape(-1)
                hh = torch.arange(gh).view(1, gh, 1).expand(t, gh, gw).reshape(-1)
                ww = torch.arange(gw).view(1, 1, gw).expand(t, gh, gw).reshape(-1)
                if i + count > n or not all(is_img[i : i + count]):
                    raise ValueError(f"image {img - 1}: expected {count} image tokens in a run (grid {t}x{h}x{w})")
                pos[0, i : i + count] = tt + cur
                pos[1, i : i + count] = hh + cur
                pos[2, i : i + count] = ww + cur
                cur += max(gh, gw)
                i += count
        positions[:, b, mask_cpu[b].to(device)] = pos.to(device)
        next_pos[b] = (int(pos.max()) + 1) if n else 0
    return positions, next_pos


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """Rotate the two halves of the last dimension: ``(x1, x2) -> (-x2, x1)`` (rotary embeddings)."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def image_embeddings(model, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor) -> torch.Tensor:
    """Merged vision features of all images, in order: ``[sum_i t*h*w/merge**2, hidden]`` (grad flows if enabled)."""
    visual = model_parts(model).visual
    out = visual(
        pixel_values.to(visual.dtype if hasattr(visual, "dtype") else pixel_values.dtype), grid_thw=image_grid_thw
    )
    return out.pooler_output if hasattr(out, "pooler_output") else out
