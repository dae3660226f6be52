"""The CLIP image-image similarity (lightning_modules/models/clip_similarity.py) on a tiny random CLIP saved to
tmp_path."""

from __future__ import annotations

import numpy as np
import pytest
from PIL import Image

from lightning_modules.models.clip_similarity import ClipSimilarity


def _tiny_clip(path, vision_only: bool):
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPVisionConfig, CLIPVisionModelWithProjection

    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8, projection_dim=8)  # fmt: skip
    torch.manual_seed(0)
    if vision_only:
        model = CLIPVisionModelWithProjection(CLIPVisionConfig(**vision))
    else:
        text = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64,
                    max_position_embeddings=16, projection_dim=8)  # fmt: skip
        model = CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=8))
    model.save_pretrained(path)
    CLIPImageProcessor(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}).save_pretrained(path)
    return model


def _image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (48, 64, 3), dtype=np.uint8))


@pytest.mark.parametrize("vision_only", [False, True], ids=["CLIPModel", "CLIPVisionModelWithProjection"])
def test_clip_similarity_from_a_local_random_clip(tmp_path, vision_only):
    import torch

    model = _tiny_clip(tmp_path, vision_only)
    sim = ClipSimilarity(tmp_path)
    a, b = _image(0), _image(1)
    assert sim(a, a) == pytest.approx(1.0, abs=1e-5)  # an image against itself
    got = sim(a, b)
    assert -1.0 <= got < 1.0
    # the same number computed by hand from the saved model: projection of the pooled vision output, cosine
    pixels = sim._processor(images=[a, b], return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        emb = model.visual_projection(model.vision_model(pixel_values=pixels).pooler_output)
    assert got == pytest.approx(float(torch.nn.functional.cosine_similarity(emb[0], emb[1], dim=0)), abs=1e-5)


def test_clip_similarity_without_a_checkpoint_names_the_folder(tmp_path):
    with pytest.raises(FileNotFoundError, match="no CLIP checkpoint"):
        ClipSimilarity(tmp_path / "missing")(_image(0), _image(1))
