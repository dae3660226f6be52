"""vLLM's Qwen2.5-VL with the project's M-RoPE positions after a video clip (imported by vLLM, inside .venv-vllm).

vLLM 0.32 continues the text after a visual block from ``max(positions) + 1``. transformers' Qwen2.5-VL (5.19 in
.venv-vllm, 5.24 in the project's environment) continues it from ``start + max(h, w) / merge``
(``qwen_vl.mrope_positions``): where the SFT stages trained the video checkpoint and where the update engines score a
completion. For an image (t = 1) the two agree; after a clip whose temporal axis (``tokens_per_second`` x seconds per
temporal patch x patches) runs past its h / w axes they do not: a 16-frame toy clip at 2 fps (8 patches, 4 tokens per
second, a 4 x 4 grid) puts every later text token, and the completion, 25 positions further in vLLM.

`Qwen2_5_VLWithProjectPositions` is vLLM's own model class with one method replaced, ``get_mrope_input_positions``
(the prompt's positions and the offset vLLM adds to every decoded token's index), which for prompts holding video
clips returns the project's positions (`qwen_vl.mrope_positions`, the one implementation the fast / packed engines
use). Everything else (weights, vision tower, the multimodal processor registered on the parent class, image prompts)
is vLLM's. It is registered with vLLM's out-of-tree model registry under `ARCH` and selected per ``LLM`` with
``hf_overrides={"architectures": [ARCH]}`` (`register`), so vLLM's own class stays untouched in the process.
"""

from __future__ import annotations

import torch
from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

from lightning_modules.models.qwen_vl import mrope_positions

__all__ = ["ARCH", "Qwen2_5_VLWithProjectPositions", "register"]

ARCH = "SynGrpoQwen2_5_VLForConditionalGeneration"
"""The architecture name the engine starts vLLM with (``hf_overrides``) for Qwen2.5-VL checkpoints."""

BASE_ARCH = "Qwen2_5_VLForConditionalGeneration"


def register() -> None:
    """Make `ARCH` known to vLLM's model registry (idempotent)."""
    from vllm import ModelRegistry

    if ARCH not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCH, f"{__name__}:Qwen2_5_VLWithProjectPositions")


class Qwen2_5_VLWithProjectPositions(Qwen2_5_VLForConditionalGeneration):
    """vLLM's Qwen2.5-VL; a prompt holding video clips gets transformers' positions (`qwen_vl.mrope_positions`)."""

    def get_mrope_input_positions(self, input_tokens, mm_features):
        videos = sorted((f for f in mm_features if f.modality == "video"), key=lambda f: f.mm_position.offset)
        if not videos:  # images only: vLLM's positions are transformers' (t = 1 never runs past h / w)
            return super().get_mrope_input_positions(input_tokens, mm_features)
        if len(videos) != len(mm_features):
            raise ValueError(
                "the vllm rollout engine takes one kind of visual input per prompt (images or video clips), got "
                f"{sorted({f.modality for f in mm_features})} in one prompt"
            )
        grids, seconds = [], []
        for f in videos:
            grids.append([int(x) for x in f.data["video_grid_thw"].data.tolist()])
            s = f.data.get("second_per_grid_ts")  # float32, as the processor gives it to transformers
            seconds.append(float(s.data.item()) if s is not None else 1.0)
        ids = torch.tensor([list(input_tokens)], dtype=torch.long)
        positions, next_pos = mrope_positions(
            self.config, ids, None, torch.tensor(grids, dtype=torch.long), torch.tensor(seconds, dtype=torch.float32)
        )
        # vLLM places the block where its processor put it: the same runs of <|video_pad|> mrope_positions walked
        merge = self.config.vision_config.spatial_merge_size
        video_id = self.config.video_token_id
        for f, (t, h, w) in zip(videos, grids):
            start, n = f.mm_position.offset, t * h * w // merge**2
            run = input_tokens[start : start + n]
            if len(run) != n or any(tok != video_id for tok in run):
                raise ValueError(f"video at offset {start}: expected {n} <|video_pad|> tokens there (grid {t}x{h}x{w})")
        # decoded token k (index len + k) sits at len + k + delta: the full forward's next_pos + k
        return positions[:, 0, :].contiguous(), int(next_pos[0]) - len(input_tokens)
