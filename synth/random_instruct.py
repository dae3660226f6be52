"""Tiny random-weight instruction image-edit pipelines built from config dicts (tests; no downloads).

``StableDiffusionInstructPix2PixPipeline`` is Stable Diffusion 1.x with a UNet of 8 input channels (the noisy latents
and the encoded input image side by side). The tiny version below (follows diffusers' own InstructPix2Pix pipeline
tests: a 2-level UNet of 32 / 64 channels, the tiny VAE and CLIP text encoder of ``synth.random_sdxl`` and its offline
byte-level tokenizer) runs 2 steps at 32 x 32 on a CPU in well under a second, so the instruction-edit painter can be
exercised through the real server. The images are noise.

``QwenImageEditPipeline`` (the seed's model) gets the same treatment (:func:`build_random_qwen_image_edit_components`)
with a tokenizer built in memory; a call takes about 6 s on one CPU core, most of it the VAE encoding the input at
the pipeline's fixed ~1 megapixel conditioning size.
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


# --- Qwen-Image-Edit ---------------------------------------------------------------------------------------------------

QWEN_SPECIAL_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>",
)  # fmt: skip
"""Qwen2's special tokens, in id order from 151643 (``<|image_pad|>`` = 151655, Qwen2.5-VL's ``image_token_id``)."""
QWEN_FIRST_SPECIAL_ID = 151643


def tiny_qwen_tokenizer():
    """A ``Qwen2Tokenizer`` that needs no files: the 256 byte characters, reserved filler ids up to 151643 and Qwen2's
    special tokens at their real ids (the pipeline's prompt template and the VL processor's image tokens need them)."""
    from transformers import Qwen2Tokenizer

    from synth.random_sdxl import _bytes_to_unicode

    vocab = {c: i for i, c in enumerate(_bytes_to_unicode().values())}
    vocab.update({f"<|reserved_{i}|>": i for i in range(len(vocab), QWEN_FIRST_SPECIAL_ID)})
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS[1:])})
    return tokenizer


def build_random_qwen_image_edit_components(seed: int = 0, device: str = "cpu", dtype: Any = None) -> dict[str, Any]:
    """Random-weight components for ``QwenImageEditPipeline(**components)``: the shapes of diffusers' own fast test
    (a 2-layer MMDiT, a Qwen2.5-VL of width 16, a 3-level VAE), the tokenizer above, and a VL processor capped at a
    few vision tokens. The pipeline itself still scales the input to about 1 megapixel for the VAE (Qwen-Image-Edit's
    fixed conditioning size), so a call costs seconds on a GPU and more on a CPU."""
    import diffusers
    import torch
    from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
    from transformers import (
        Qwen2_5_VLConfig,
        Qwen2_5_VLForConditionalGeneration,
        Qwen2VLImageProcessor,
        Qwen2VLProcessor,
        Qwen2VLVideoProcessor,
    )

    diffusers.utils.logging.set_verbosity_error()
    tokenizer = tiny_qwen_tokenizer()
    image_processor = Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=28 * 28 * 16)
    video_processor = Qwen2VLVideoProcessor()  # required by the processor's signature; no video is ever sent
    processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor)
    z = 4
    config = Qwen2_5_VLConfig(
        text_config=dict(
            hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
            rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"},
            rope_theta=1000000.0, vocab_size=len(tokenizer),
        ),
        vision_config=dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16),
        hidden_size=16, vocab_size=len(tokenizer), vision_start_token_id=151652, vision_end_token_id=151653,
        image_token_id=151655, video_token_id=151656,
    )  # fmt: skip
    torch.manual_seed(seed)
    with torch.device(device):
        modules = dict(
            transformer=QwenImageTransformer2DModel(
                patch_size=2, in_channels=4 * z, out_channels=z, num_layers=2, attention_head_dim=16,
                num_attention_heads=3, joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
            ),
            vae=AutoencoderKLQwenImage(
                base_dim=z * 6, z_dim=z, dim_mult=[1, 2, 4, 4], num_res_blocks=1,
                temperal_downsample=[False, True, True], latents_mean=[0.0] * z, latents_std=[1.0] * z,
            ),
            text_encoder=Qwen2_5_VLForConditionalGeneration(config),
        )  # fmt: skip
    for m in modules.values():
        m.eval().requires_grad_(False)
        if dtype is not None:
            m.to(dtype=dtype)
    return dict(**modules, tokenizer=tokenizer, processor=processor, scheduler=FlowMatchEulerDiscreteScheduler())
