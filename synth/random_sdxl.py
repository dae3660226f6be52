"""Random-weight SDXL + ControlNet components built from config dicts, with an offline CLIP tokenizer.

Used by the tests (``size="tiny"``: a pipeline that runs 2 steps at 64 x 64 on a CPU in about a second) and by
``bench/synth_throughput.py --sdxl`` (``size="full"``: the real SDXL-base UNet, ControlNet, VAE and both CLIP text
encoders, random weights). Nothing here downloads anything: the architectures are the config dicts below (copied from
the public ``config.json`` files of stabilityai/stable-diffusion-xl-base-1.0 and the SDXL ControlNets), and the
tokenizer is a byte-level CLIP BPE with no merges whose vocab and merges files are written to a temporary directory.

Only torch, diffusers and transformers are imported, so the GPU benchmark runs on a machine that has nothing else.
"""

from __future__ import annotations

import json
import os
import tempfile
from typing import Any

# --- architectures -------------------------------------------------------------------------------------------------

# stabilityai/stable-diffusion-xl-base-1.0, unet/config.json (2.57B parameters).
FULL_UNET: dict[str, Any] = dict(
    act_fn="silu",
    addition_embed_type="text_time",
    addition_embed_type_num_heads=64,
    addition_time_embed_dim=256,
    attention_head_dim=[5, 10, 20],
    block_out_channels=[320, 640, 1280],
    center_input_sample=False,
    cross_attention_dim=2048,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    downsample_padding=1,
    flip_sin_to_cos=True,
    freq_shift=0,
    in_channels=4,
    layers_per_block=2,
    mid_block_scale_factor=1,
    norm_eps=1e-5,
    norm_num_groups=32,
    out_channels=4,
    projection_class_embeddings_input_dim=2816,
    sample_size=128,
    transformer_layers_per_block=[1, 2, 10],
    up_block_types=["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    use_linear_projection=True,
)

# The SDXL ControlNets (diffusers/controlnet-canny-sdxl-1.0, xinsir/controlnet-union-sdxl-1.0): a copy of the UNet
# encoder (1.25B parameters) plus the conditioning embedding.
FULL_CONTROLNET: dict[str, Any] = dict(
    act_fn="silu",
    addition_embed_type="text_time",
    addition_embed_type_num_heads=64,
    addition_time_embed_dim=256,
    attention_head_dim=[5, 10, 20],
    block_out_channels=[320, 640, 1280],
    conditioning_embedding_out_channels=[16, 32, 96, 256],
    cross_attention_dim=2048,
    down_block_types=["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    downsample_padding=1,
    flip_sin_to_cos=True,
    freq_shift=0,
    in_channels=4,
    layers_per_block=2,
    mid_block_scale_factor=1,
    norm_eps=1e-5,
    norm_num_groups=32,
    projection_class_embeddings_input_dim=2816,
    transformer_layers_per_block=[1, 2, 10],
    use_linear_projection=True,
)
# ControlNet-Union ProMax adds a mode embedding and a small transformer; 8 control types (7 = repaint / inpaint).
FULL_UNION_EXTRA: dict[str, Any] = dict(
    num_control_type=8, num_trans_channel=320, num_trans_head=8, num_trans_layer=1, num_proj_channel=320
)

# stabilityai/stable-diffusion-xl-base-1.0, vae/config.json (madebyollin's fp16-fix has the same architecture).
FULL_VAE: dict[str, Any] = dict(
    act_fn="silu",
    block_out_channels=[128, 256, 512, 512],
    down_block_types=["DownEncoderBlock2D"] * 4,
    up_block_types=["UpDecoderBlock2D"] * 4,
    in_channels=3,
    out_channels=3,
    latent_channels=4,
    layers_per_block=2,
    norm_num_groups=32,
    sample_size=1024,
    scaling_factor=0.13025,
    force_upcast=False,
)

# text_encoder (CLIP ViT-L/14) and text_encoder_2 (OpenCLIP ViT-bigG/14), random weights, real sizes.
FULL_TEXT_1: dict[str, Any] = dict(
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    hidden_act="quick_gelu",
    projection_dim=768,
    vocab_size=49408,
)
FULL_TEXT_2: dict[str, Any] = dict(
    hidden_size=1280,
    intermediate_size=5120,
    num_hidden_layers=32,
    num_attention_heads=20,
    max_position_embeddings=77,
    hidden_act="gelu",
    projection_dim=1280,
    vocab_size=49408,
)

# The tiny versions follow diffusers' own SDXL ControlNet inpaint pipeline tests.
TINY_UNET: dict[str, Any] = dict(
    block_out_channels=(32, 64),
    layers_per_block=2,
    sample_size=32,
    in_channels=4,
    out_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "UpBlock2D"),
    attention_head_dim=(2, 4),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    transformer_layers_per_block=(1, 2),
    projection_class_embeddings_input_dim=80,  # 6 * addition_time_embed_dim + text_encoder_2 projection_dim
    cross_attention_dim=64,  # text_encoder hidden + text_encoder_2 hidden
)
TINY_CONTROLNET: dict[str, Any] = dict(
    block_out_channels=(32, 64),
    layers_per_block=2,
    in_channels=4,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D"),
    conditioning_embedding_out_channels=(16, 32),
    attention_head_dim=(2, 4),
    use_linear_projection=True,
    addition_embed_type="text_time",
    addition_time_embed_dim=8,
    transformer_layers_per_block=(1, 2),
    projection_class_embeddings_input_dim=80,
    cross_attention_dim=64,
)
TINY_UNION_EXTRA: dict[str, Any] = dict(
    num_control_type=8, num_trans_channel=32, num_trans_head=2, num_trans_layer=1, num_proj_channel=32
)
TINY_VAE: dict[str, Any] = dict(
    block_out_channels=[32, 64],
    in_channels=3,
    out_channels=3,
    down_block_types=["DownEncoderBlock2D", "DownEncoderBlock2D"],
    up_block_types=["UpDecoderBlock2D", "UpDecoderBlock2D"],
    latent_channels=4,
)
TINY_TEXT: dict[str, Any] = dict(
    hidden_size=32,
    intermediate_size=37,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=77,
    hidden_act="gelu",
    projection_dim=32,
)

# SDXL's default scheduler (EulerDiscreteScheduler, scheduler/scheduler_config.json).
SCHEDULER: dict[str, Any] = dict(
    beta_start=0.00085,
    beta_end=0.012,
    beta_schedule="scaled_linear",
    num_train_timesteps=1000,
    prediction_type="epsilon",
    steps_offset=1,
    timestep_spacing="leading",
    interpolation_type="linear",
    use_karras_sigmas=False,
)


# --- tokenizer -----------------------------------------------------------------------------------------------------


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 / CLIP byte -> printable unicode character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def write_tiny_clip_tokenizer(directory: str) -> str:
    """Write a byte-level CLIP BPE tokenizer (vocab.json, merges.txt, tokenizer_config.json) to ``directory``.

    The vocab holds the 256 byte characters, each also with the end-of-word suffix ``</w>``, then
    ``<|startoftext|>`` and ``<|endoftext|>`` as the two highest ids (514 tokens), and no merges: every byte of a word
    is one token. The highest id is the end-of-text token, which is what CLIP's pooling looks for.
    """
    chars = list(_bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "vocab.json"), "w", encoding="utf-8") as f:
        json.dump(vocab, f)
    with open(os.path.join(directory, "merges.txt"), "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n")
    with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump({"tokenizer_class": "CLIPTokenizer", "model_max_length": 77}, f)
    return directory


def tiny_clip_tokenizer(directory: str | None = None):
    """A ``CLIPTokenizer`` loaded from files written by :func:`write_tiny_clip_tokenizer` (no network)."""
    from transformers import CLIPTokenizer

    if directory is not None:
        return CLIPTokenizer.from_pretrained(write_tiny_clip_tokenizer(directory), local_files_only=True)
    with tempfile.TemporaryDirectory(prefix="synth-clip-tok-") as tmp:
        return CLIPTokenizer.from_pretrained(write_tiny_clip_tokenizer(tmp), local_files_only=True)


# --- components ----------------------------------------------------------------------------------------------------


def build_random_sdxl_components(
    size: str = "tiny",
    union: bool = False,
    seed: int = 0,
    device: str = "cpu",
    dtype: Any = None,
) -> dict[str, Any]:
    """Random-weight components for ``StableDiffusionXLControlNet(Union)InpaintPipeline(**components)``.

    ``size`` is ``"tiny"`` or ``"full"``; ``union`` picks ``ControlNetUnionModel`` over ``ControlNetModel``. Modules are
    built directly on ``device`` (so the full 4.6B parameters never pass through host memory) and cast to ``dtype``.
    """
    import diffusers
    import torch
    from diffusers import (
        AutoencoderKL,
        ControlNetModel,
        ControlNetUnionModel,
        EulerDiscreteScheduler,
        UNet2DConditionModel,
    )
    from transformers import CLIPTextConfig, CLIPTextModel, CLIPTextModelWithProjection

    diffusers.utils.logging.set_verbosity_error()  # no "should be kept in float32" notes for random modules
    if size not in ("tiny", "full"):
        raise ValueError(f"size must be 'tiny' or 'full', got {size!r}")
    full = size == "full"
    tokenizer = tiny_clip_tokenizer()
    eos = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    bos = tokenizer.convert_tokens_to_ids("<|startoftext|>")
    special = dict(bos_token_id=bos, eos_token_id=eos, pad_token_id=eos)
    text_1 = dict(FULL_TEXT_1 if full else TINY_TEXT, **special)
    text_2 = dict(FULL_TEXT_2 if full else TINY_TEXT, **special)
    if not full:
        text_1["vocab_size"] = text_2["vocab_size"] = len(tokenizer)
    cn_cfg = dict(FULL_CONTROLNET if full else TINY_CONTROLNET)
    if union:
        cn_cfg.update(FULL_UNION_EXTRA if full else TINY_UNION_EXTRA)
    cn_cls = ControlNetUnionModel if union else ControlNetModel

    torch.manual_seed(seed)
    with torch.device(device):
        unet = UNet2DConditionModel(**(FULL_UNET if full else TINY_UNET))
        controlnet = cn_cls(**cn_cfg)
        vae = AutoencoderKL(**(FULL_VAE if full else TINY_VAE))
        text_encoder = CLIPTextModel(CLIPTextConfig(**text_1))
        text_encoder_2 = CLIPTextModelWithProjection(CLIPTextConfig(**text_2))
    modules = dict(unet=unet, controlnet=controlnet, vae=vae, text_encoder=text_encoder, text_encoder_2=text_encoder_2)
    for m in modules.values():
        m.eval().requires_grad_(False)
        if dtype is not None:
            m.to(dtype=dtype)
    return dict(
        **modules,
        tokenizer=tokenizer,
        tokenizer_2=tokenizer,
        scheduler=EulerDiscreteScheduler(**SCHEDULER),
    )


def count_parameters(components: dict[str, Any]) -> dict[str, int]:
    """Parameter count of each torch module among ``components``."""
    return {k: sum(p.numel() for p in v.parameters()) for k, v in components.items() if hasattr(v, "parameters")}
