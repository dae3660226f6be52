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

from synth.random_sdxl import SCHEDULER, TINY_TEXT, TINY_VAE, _bytes_to_unicode, tiny_clip_tokenizer

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

    vocab = {c: i for i, c in enumerate(_bytes_to_unicode().values())}
    vocab.update({f"<|reserved_{i}|>": i for i in range(len(vocab), QWEN_FIRST_SPECIAL_ID)})
    tokenizer = Qwen2Tokenizer(vocab=vocab, merges=[])
    tokenizer.add_special_tokens({"additional_special_tokens": list(QWEN_SPECIAL_TOKENS[1:])})
    return tokenizer


# Qwen/Qwen-Image-Edit's text encoder is Qwen2.5-VL-7B-Instruct (its config.json's numbers); the MMDiT (20B) and the
# VAE are the diffusers classes' defaults, which are Qwen-Image's own.
FULL_QWEN_TEXT: dict[str, Any] = dict(
    hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
    rope_scaling={"mrope_section": [16, 24, 24], "rope_type": "default", "type": "default"}, rope_theta=1000000.0,
    max_position_embeddings=128000, rms_norm_eps=1e-6, vocab_size=152064,
)  # fmt: skip
FULL_QWEN_VISION: dict[str, Any] = dict(
    depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, out_hidden_size=3584, window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31], patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_chans=3,
    hidden_act="silu",
)  # fmt: skip
TINY_QWEN_TEXT: dict[str, Any] = dict(
    hidden_size=16, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2,
    rope_scaling={"mrope_section": [1, 1, 2], "rope_type": "default", "type": "default"}, rope_theta=1000000.0,
)  # fmt: skip
TINY_QWEN_VISION: dict[str, Any] = dict(depth=2, hidden_size=16, intermediate_size=16, num_heads=2, out_hidden_size=16)
TINY_QWEN_TRANSFORMER: dict[str, Any] = dict(
    patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=3,
    joint_attention_dim=16, guidance_embeds=False, axes_dims_rope=(8, 4, 4),
)  # fmt: skip
TINY_QWEN_VAE: dict[str, Any] = dict(
    base_dim=24, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=1, temperal_downsample=[False, True, True],
    latents_mean=[0.0] * 4, latents_std=[1.0] * 4,
)  # fmt: skip


def build_random_qwen_image_edit_components(
    size: str = "tiny", seed: int = 0, device: str = "cpu", dtype: Any = None
) -> dict[str, Any]:
    """Random-weight components for ``QwenImageEditPipeline(**components)`` with the in-memory tokenizer above.

    ``size="tiny"``: the shapes of diffusers' own fast test (a 2-layer MMDiT, a Qwen2.5-VL of width 16, a 4-level
    VAE) and a VL processor capped at a few vision tokens; the pipeline still scales the input to about 1 megapixel
    for the VAE (Qwen-Image-Edit's fixed conditioning size), so a call costs seconds. ``size="full"``: the real
    architectures (20B MMDiT, Qwen2.5-VL-7B, the Qwen-Image VAE), built directly on ``device`` in ``dtype`` (about
    58 GB in bf16), for timing the painter on a GPU without the weights.
    """
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

    if size not in ("tiny", "full"):
        raise ValueError(f"size must be 'tiny' or 'full', got {size!r}")
    full = size == "full"
    diffusers.utils.logging.set_verbosity_error()
    tokenizer = tiny_qwen_tokenizer()
    image_processor = Qwen2VLImageProcessor() if full else Qwen2VLImageProcessor(min_pixels=3136, max_pixels=12544)
    video_processor = Qwen2VLVideoProcessor()  # required by the processor's signature; no video is ever sent
    processor = Qwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, video_processor=video_processor)
    text = FULL_QWEN_TEXT if full else dict(TINY_QWEN_TEXT, vocab_size=len(tokenizer))
    config = Qwen2_5_VLConfig(
        text_config=text, vision_config=FULL_QWEN_VISION if full else TINY_QWEN_VISION,
        hidden_size=text["hidden_size"], vocab_size=text["vocab_size"], vision_start_token_id=151652,
        vision_end_token_id=151653, image_token_id=151655, video_token_id=151656,
    )  # fmt: skip
    torch.manual_seed(seed)
    default_dtype = torch.get_default_dtype()
    if full and dtype is not None:
        torch.set_default_dtype(dtype)  # never materialise 28B parameters in fp32
    try:
        with torch.device(device):
            modules = dict(
                transformer=QwenImageTransformer2DModel(**({} if full else TINY_QWEN_TRANSFORMER)),
                vae=AutoencoderKLQwenImage(**({} if full else TINY_QWEN_VAE)),
                text_encoder=Qwen2_5_VLForConditionalGeneration(config),
            )
    finally:
        torch.set_default_dtype(default_dtype)
    for m in modules.values():
        m.eval().requires_grad_(False)
        if dtype is not None:
            m.to(dtype=dtype)
    return dict(**modules, tokenizer=tokenizer, processor=processor, scheduler=FlowMatchEulerDiscreteScheduler())
