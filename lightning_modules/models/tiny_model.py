"""The tiny model factory: the same classes as Qwen2.5-VL-7B, a few million parameters, a locally trained tokenizer.

``build_tiny_qwen2_5_vl`` makes a small ``Qwen2_5_VLForConditionalGeneration`` with a locally trained byte-level BPE
tokenizer, a Qwen2.5-VL processor (image, video processor, chat template) and saves it with ``save_pretrained``: the
tests' factory and the starting point of the embedded toy checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from pathlib import Path

import torch

from core.prompts import CHAT_TEMPLATE, CHAT_TEMPLATE_IMAGE_LAST, QWEN_SPECIAL_TOKENS
from lightning_modules.models.prompts import eos_token_ids

# --------------------------------------------------------------------------------------------------------------------
# The tiny model factory: same classes as Qwen2.5-VL-7B, a few million parameters, a locally trained tokenizer.
# --------------------------------------------------------------------------------------------------------------------


QWEN2_SPLIT_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""The pre-tokenizer split pattern of Qwen2 / Qwen2.5 (tokenizer.json of Qwen2.5-VL-7B-Instruct)."""


def train_bpe_tokenizer(corpus: Iterable[str], vocab_size: int = 1024, split_digits: bool = True):
    """A byte-level BPE ``PreTrainedTokenizerFast`` trained on ``corpus`` with Qwen2.5-VL's special tokens.

    ``split_digits`` uses Qwen2's pre-tokenizer (one token per digit); False keeps GPT-2's byte-level pattern, under
    which whole numbers of the corpus ("112") become single tokens.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    # Qwen2's pre-tokenizer: its split pattern (every digit on its own, so "112" is "1", "1", "2" as in the 7B's
    # vocabulary), then byte-level mapping without GPT-2's own pattern.
    bpe.pre_tokenizer = (
        pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
        if split_digits
        else pre_tokenizers.ByteLevel(add_prefix_space=False)
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(QWEN_SPECIAL_TOKENS),
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    bpe.train_from_iterator(list(corpus), trainer=trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=[t for t in QWEN_SPECIAL_TOKENS if t not in ("<|im_end|>", "<|endoftext|>")],
        model_max_length=4096,
        padding_side="left",
    )
    return tok


def tiny_qwen2_5_vl_config(
    vocab_size: int,
    tokenizer=None,
    *,
    hidden_size: int = 128,
    layers: int = 4,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int = 384,
    vision_hidden_size: int = 64,
    vision_depth: int = 2,
    vision_heads: int = 2,
    rope_theta: float = 10000.0,
    mrope_section: list[int] | None = None,
):
    """A ``Qwen2_5_VLConfig`` of the 7B's shape in every respect but size (mRoPE, window attention, merger).

    ``rope_theta`` / ``mrope_section`` matter at this size: mRoPE gives the (t, h, w) sections contiguous slices of the
    rotary frequencies, highest first, so with the 7B's theta and a 32-dim head the w section rotates by a few
    hundredths of a radian across a toy image's 8 columns, and a small model cannot read column positions at all.
    """
    from transformers import Qwen2_5_VLConfig

    head_dim = hidden_size // heads
    # mRoPE splits the rotary half-dimension into (t, h, w) sections; the 7B uses [16, 24, 24] of 64.
    half = head_dim // 2
    hw = (half - half // 4) // 2
    mrope = list(mrope_section) if mrope_section else [half - 2 * hw, hw, hw]
    if sum(mrope) != half:
        raise ValueError(f"mrope_section {mrope} must sum to head_dim / 2 = {half}")
    ids = {}
    if tokenizer is not None:
        for key, tok in (
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
        ):
            ids[key] = tokenizer.convert_tokens_to_ids(tok)
    text = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": float(rope_theta), "mrope_section": mrope},
        tie_word_embeddings=True,
    )
    if tokenizer is not None:
        text.update(
            bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
            eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
            pad_token_id=tokenizer.pad_token_id,
        )
    vision = dict(
        depth=vision_depth,
        hidden_size=vision_hidden_size,
        intermediate_size=vision_hidden_size * 2,
        num_heads=vision_heads,
        out_hidden_size=hidden_size,
        patch_size=14,
        spatial_merge_size=2,
        temporal_patch_size=2,
        window_size=112,
        fullatt_block_indexes=[vision_depth - 1],
    )
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)


def build_processor(tokenizer, image_size: int = 224, image_last: bool = False):
    """A Qwen2.5-VL processor whose image processor keeps ``image_size`` x ``image_size`` inputs at that size.

    ``image_last``: its chat template puts images after the text of a turn (``CHAT_TEMPLATE_IMAGE_LAST``)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    side = math.ceil(image_size / 28) * 28
    image_processor = Qwen2VLImageProcessor(min_pixels=28 * 28 * 4, max_pixels=side * side)
    return Qwen2_5_VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(),
        chat_template=CHAT_TEMPLATE_IMAGE_LAST if image_last else CHAT_TEMPLATE,
    )


def sampling_generation_config(tokenizer):
    """The tiny checkpoints' generation config: plain sampling at temperature 1 (no top-k / top-p), stopping at the
    chat template's end-of-turn tokens."""
    from transformers import GenerationConfig

    return GenerationConfig(
        eos_token_id=eos_token_ids(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        do_sample=True,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
    )


def build_tiny_qwen2_5_vl(
    out_dir: str | Path,
    corpus: Iterable[str],
    *,
    vocab_size: int = 1024,
    image_size: int = 224,
    seed: int = 0,
    image_last: bool = False,
    split_digits: bool = True,
    **config_kwargs,
) -> Path:
    """Train a tokenizer on ``corpus``, build a tiny Qwen2.5-VL + processor and ``save_pretrained`` both to ``out_dir``.

    The result loads with ``load_policy(out_dir)`` exactly like a real checkpoint.
    """
    from transformers import Qwen2_5_VLForConditionalGeneration

    out_dir = Path(out_dir)
    tokenizer = train_bpe_tokenizer(corpus, vocab_size=vocab_size, split_digits=split_digits)
    processor = build_processor(tokenizer, image_size=image_size, image_last=image_last)
    config = tiny_qwen2_5_vl_config(len(tokenizer), tokenizer, **config_kwargs)
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(config)
    model.generation_config = sampling_generation_config(tokenizer)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir


def build_tiny_qwen3_vl(
    out_dir: str | Path,
    tokenizer_dir: str | Path,
    *,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    intermediate_size: int = 128,
    vision_hidden_size: int = 32,
    vision_depth: int = 2,
    vision_heads: int = 2,
    image_size: int = 224,
    seed: int = 0,
    head_dim: int | None = None,
    mrope_section: list[int] | None = None,
    rope_theta: float = 10000.0,
    vision_intermediate_size: int | None = None,
    deepstack_visual_indexes: tuple[int, ...] = (0,),
    num_position_embeddings: int | None = None,
    device: str = "cpu",
    dtype: torch.dtype | None = None,
) -> Path:
    """A random tiny ``Qwen3VLForConditionalGeneration`` (the classes of Qwen3-VL-4B: interleaved mRoPE, DeepStack
    visual features injected into the first decoder layers, 16-pixel patches) with the tokenizer and chat template of
    ``tokenizer_dir`` (a tiny Qwen2.5-VL's: the same special tokens), saved with ``save_pretrained``; for the tests
    of the Qwen3-VL configs (``configs/cycle_4b.yaml``) on the CPU. The keyword dimensions also build the real sizes
    with random weights (``bench/e2e_gpu.py --arch qwen3vl-4b``: Qwen3-VL-4B's published config), on ``device`` in
    ``dtype``."""
    from transformers import (
        AutoProcessor,
        Qwen2VLImageProcessor,
        Qwen3VLConfig,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    out_dir = Path(out_dir)
    source = AutoProcessor.from_pretrained(tokenizer_dir, local_files_only=True)
    tok = source.tokenizer
    ids = {
        key: tok.convert_tokens_to_ids(t)
        for key, t in (
            ("image_token_id", "<|image_pad|>"),
            ("video_token_id", "<|video_pad|>"),
            ("vision_start_token_id", "<|vision_start|>"),
            ("vision_end_token_id", "<|vision_end|>"),
        )
    }
    head_dim = head_dim or hidden_size // heads
    half = head_dim // 2
    hw = (half - half // 4) // 2
    mrope_section = list(mrope_section or [half - 2 * hw, hw, hw])
    text = dict(
        vocab_size=len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": rope_theta,
            "mrope_section": mrope_section,
            "mrope_interleaved": True,
        },
        tie_word_embeddings=True,
        bos_token_id=tok.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tok.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tok.pad_token_id,
    )
    side = math.ceil(image_size / 32) * 32
    vision = dict(
        depth=vision_depth,
        hidden_size=vision_hidden_size,
        intermediate_size=vision_intermediate_size or vision_hidden_size * 2,
        num_heads=vision_heads,
        out_hidden_size=hidden_size,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        deepstack_visual_indexes=list(deepstack_visual_indexes),  # the 4B injects 3 vision layers' features
        num_position_embeddings=num_position_embeddings or (side // 16) ** 2,
    )
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3VLForConditionalGeneration._from_config(config, dtype=dtype or torch.float32)
    model.generation_config = sampling_generation_config(tok)
    image_processor = Qwen2VLImageProcessor(
        patch_size=16,
        merge_size=2,
        min_pixels=32 * 32 * 4,
        max_pixels=side * side,
        image_mean=[0.5] * 3,
        image_std=[0.5] * 3,
    )  # Qwen3-VL's: 16-pixel patches, 32-pixel merged tokens, mean / std 0.5
    processor = Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tok,
        video_processor=Qwen3VLVideoProcessor(),
        chat_template=source.chat_template or CHAT_TEMPLATE,
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir)
    processor.save_pretrained(out_dir)
    return out_dir
