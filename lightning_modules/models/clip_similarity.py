"""The CLIP image-image similarity of EvolvedGRPO's question generator: ``p_step`` of an image edit
(`core.question_rewards.image_step_probability` gates and clips it; docs/evolved_coevolution.md).

It runs a model, so it sits here rather than beside the reward terms in ``core/question_rewards.py``; on the toy
visual-math world `core.question_rewards.toy_similarity` stands in for it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

__all__ = ["ClipSimilarity"]


class ClipSimilarity:
    """Cosine similarity of two images' CLIP embeddings, from a local folder (no download).

    The folder holds a ``CLIPModel`` (e.g. openai/clip-vit-large-patch14, as the seed) or a
    ``CLIPVisionModelWithProjection``, and its ``CLIPImageProcessor``. Loaded on first use; ``embeddings =
    visual_projection(vision_model(pixels).pooler_output)``, the same for both classes, L2-normalised in fp32.
    """

    def __init__(self, path: str | Path, device: str = "cpu", dtype: str = "float32") -> None:
        self.path = Path(path)
        self.device = device
        self.dtype = dtype
        self._model = None
        self._processor = None

    def _load(self) -> None:
        if self._model is not None:
            return
        from transformers import AutoConfig, CLIPImageProcessor, CLIPModel, CLIPVisionModelWithProjection

        if not (self.path / "config.json").is_file():
            raise FileNotFoundError(
                f"no CLIP checkpoint at {self.path} (config.json missing): save a CLIPModel or "
                "CLIPVisionModelWithProjection there with save_pretrained, and its CLIPImageProcessor"
            )
        model_type = AutoConfig.from_pretrained(self.path, local_files_only=True).model_type
        cls = CLIPModel if model_type == "clip" else CLIPVisionModelWithProjection
        model = cls.from_pretrained(self.path, local_files_only=True, dtype=getattr(torch, self.dtype))
        self._model = model.to(self.device).eval()
        self._processor = CLIPImageProcessor.from_pretrained(self.path, local_files_only=True)

    def embed(self, images: Sequence[Any]) -> torch.Tensor:
        """``[N, D]`` L2-normalised fp32 embeddings of N PIL images."""
        self._load()
        pixels = self._processor(images=[im.convert("RGB") for im in images], return_tensors="pt")["pixel_values"]
        model = self._model
        with torch.inference_mode():
            pooled = model.vision_model(pixel_values=pixels.to(self.device, model.dtype)).pooler_output  # [N, H]
            emb = model.visual_projection(pooled).float()  # [N, D]
        return torch.nn.functional.normalize(emb, dim=-1)

    def __call__(self, source: Any, edited: Any) -> float:
        """The cosine similarity in [-1, 1] of ``source`` and ``edited`` (PIL images)."""
        emb = self.embed([source, edited])
        return float((emb[0] * emb[1]).sum())
