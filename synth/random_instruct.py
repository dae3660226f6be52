"""A tiny random-weight InstructPix2Pix pipeline built from config dicts (tests; no downloads).

``StableDiffusionInstructPix2PixPipeline`` is Stable Diffusion 1.x with a UNet of 8 input channels (the noisy latents
and the encoded input image side by side). The tiny version below (follows diffusers' own InstructPix2Pix pipeline
tests: a 2-level UNet of 32 / 64 channels, the tiny VAE and CLIP text encoder of ``synth.random_sdxl`` and its offline
byte-level tokenizer) runs 2 steps at 32 x 32 on a CPU in well under a second, so the instruction-edit painter can be
exercised through the real server. The images are noise.
"""

from __future__ import annotations

from typing import Any

from synth.random_sdxl import SCHEDULER, TINY_TEXT, TINY_VAE, tiny_clip_tokenizer

TINY_PIX2PIX_UNET: dict[str, Any] = dict(
    block_out_channels=(32, 64),
    layers_per_block=2,
    sample_size=32,
    in_channels=8,  # noisy latents + the input image's latents
    out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    cross_attention_dim=32,  # TINY_TEXT's hidden size
)


ANCESTRAL_KEYS = ("beta_start", "beta_end", "beta_schedule", "num_train_timesteps", "prediction_type", "steps_offset")
"""The SD schedule's settings that ``EulerAncestralDiscreteScheduler`` (InstructPix2Pix's scheduler) takes."""


def build_random_pix2pix_components(seed: int = 0, device: str = "cpu", dtype: Any = None) -> dict[str, Any]:
    """Random-weight components for ``StableDiffusionInstructPix2PixPipeline(**components)`` (no safety checker)."""
    import diffusers
    import torch
    from diffusers import AutoencoderKL, EulerAncestralDiscreteScheduler, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    diffusers.utils.logging.set_verbosity_error()
    tokenizer = tiny_clip_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    bos = tokenizer.convert_tokens_to_ids("<|startoftext|>")
    text = dict(TINY_TEXT, vocab_size=len(tokenizer), bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
    torch.manual_seed(seed)
    with torch.device(device):
        modules = dict(
            unet=UNet2DConditionModel(**TINY_PIX2PIX_UNET),
            vae=AutoencoderKL(**TINY_VAE),
            text_encoder=CLIPTextModel(CLIPTextConfig(**text)),
        )
    for m in modules.values():
        m.eval().requires_grad_(False)
        if dtype is not None:
            m.to(dtype=dtype)
    return dict(
        **modules,
        tokenizer=tokenizer,
        scheduler=EulerAncestralDiscreteScheduler(**{k: SCHEDULER[k] for k in ANCESTRAL_KEYS}),
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    )
