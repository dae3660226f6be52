"""Loading the policy: ``(model, processor)`` for Qwen2.5-VL (and any HF image-text-to-text model with a chat template).

The same code path serves the 7B checkpoint on a GPU node and the project's toy checkpoint on a laptop:
``load_policy`` calls ``AutoModelForImageTextToText.from_pretrained`` / ``AutoProcessor.from_pretrained`` on a local
directory or a hub id (``local_files_only`` by default, so nothing downloads unless asked). The toy checkpoint itself
is built by ``models/tiny_model.py``.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, Literal

import torch

from lightning_modules.models.mask_tokenizer.vocab import add_mask_tokens


def dtype_from_name(name: str | torch.dtype | None) -> torch.dtype | None:
    """``"bf16"``, ``"bfloat16"``, ``"fp16"``, ``"fp32"``, ``"auto"`` (bf16 on CUDA, fp32 on CPU) or ``None``."""
    if name is None or isinstance(name, torch.dtype):
        return name
    table = {
        "bf16": torch.bfloat16,
        "bfloat16": torch.bfloat16,
        "fp16": torch.float16,
        "float16": torch.float16,
        "fp32": torch.float32,
        "float32": torch.float32,
    }
    if name == "auto":
        return torch.bfloat16 if torch.cuda.is_available() else torch.float32
    if name not in table:
        raise ValueError(f"--model.policy.dtype must be one of auto, {', '.join(table)}; got {name!r}")
    return table[name]


@dataclass(frozen=True)
class PolicyArgs:
    """The policy and how it is loaded (``--model.policy.*``; `GRPOModule` and `SFTModule` alike).

    Args:
        model_name_or_path: local directory (``save_pretrained`` output) or hub id of the policy.
        dtype: ``auto`` (bf16 on CUDA, fp32 on CPU), ``bf16``, ``fp16`` or ``fp32``.
        attn_implementation: ``sdpa``, ``eager`` or ``flash_attention_2``.
        local_files_only: never download weights (set false only where the hub is reachable).
        gradient_checkpointing: trade compute for memory in the policy forward (each decoder layer and vision block
            recomputes its activations in backward).
        freeze_vision: keep the vision tower's weights fixed (no gradient, no optimizer state; Generalized CycleGRPO
            freezes it).
        mask_tokens: add CycleGRPO's 514 mask tokens (``<|mt_start|>``, ``<|mt_0000|>``..``<|mt_0511|>``,
            ``<|mt_end|>``: the repository's id order) to the tokenizer and the embeddings, new rows at the mean of the
            old ones (``models/mask_tokenizer/vocab.py``; a no-op for a checkpoint that already has them).
    """

    model_name_or_path: str = "checkpoints/toy-qwen2.5-vl"
    dtype: Literal["auto", "bf16", "fp16", "fp32"] = "auto"
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] | None = "sdpa"
    local_files_only: bool = True
    gradient_checkpointing: bool = False
    freeze_vision: bool = False
    mask_tokens: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "bf16", "fp16", "fp32"):
            raise ValueError(f"--model.policy.dtype must be auto, bf16, fp16 or fp32, got {self.dtype!r}")


def as_group(cls, value: Any, flag: str):
    """``value`` as group ``cls``: an instance passes, a mapping (a checkpoint's hyperparameters, a test's dict) is
    built into one, anything else is an error naming ``--model.<flag>``."""
    if isinstance(value, cls):
        return value
    if value is None:
        return cls()
    if isinstance(value, dict):
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"--model.{flag}: unknown key(s) {unknown}; the keys are {sorted(known)}")
        return cls(**value)
    raise TypeError(f"--model.{flag} must be a mapping of {sorted(f.name for f in fields(cls))}, got {value!r}")


def prepare_policy(model, p: PolicyArgs, processor=None) -> None:
    """What ``p`` asks of a loaded policy beyond loading: mask tokens (which need the ``processor``), a frozen vision
    tower, gradient checkpointing."""
    if p.mask_tokens:
        if processor is None:
            raise ValueError("--model.policy.mask_tokens: prepare_policy(model, p, processor) needs the processor")

        add_mask_tokens(model, processor)
    if p.freeze_vision:
        vision = getattr(getattr(model, "model", model), "visual", None)
        if vision is None:
            raise ValueError(
                f"--model.policy.freeze_vision: {type(model).__name__} has no model.visual (a Qwen2-VL-family vision "
                "tower)"
            )
        vision.requires_grad_(False)
    if p.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.config.use_cache = False


def load_policy(
    name_or_path: str,
    *,
    dtype: str | torch.dtype | None = "auto",
    attn_implementation: str | None = "sdpa",
    local_files_only: bool = True,
    trust_remote_code: bool = False,
):
    """Load ``(model, processor)`` with ``from_pretrained`` from a local directory or a hub id.

    ``local_files_only=True`` keeps a run from downloading: point ``--model.policy.model_name_or_path`` at a local copy, or
    set ``--model.policy.local_files_only false`` where the hub is reachable.
    """
    from transformers import AutoModelForImageTextToText, AutoProcessor

    path = Path(name_or_path).expanduser()
    looks_local = name_or_path.startswith((".", "/", "~")) or path.exists()
    if looks_local and not (path / "config.json").exists():
        raise FileNotFoundError(
            f"--model.policy.model_name_or_path={name_or_path!r}: no config.json there. Point it at a directory written by "
            "save_pretrained (e.g. a downloaded Qwen/Qwen2.5-VL-7B-Instruct), or rebuild the toy checkpoint with "
            "`python train.py fit --config configs/toy_sft.yaml`."
        )
    src = str(path) if looks_local else name_or_path
    try:
        processor = AutoProcessor.from_pretrained(
            src, local_files_only=local_files_only, trust_remote_code=trust_remote_code
        )
        model = AutoModelForImageTextToText.from_pretrained(
            src,
            dtype=dtype_from_name(dtype),
            attn_implementation=attn_implementation,
            local_files_only=local_files_only,
            trust_remote_code=trust_remote_code,
        )
    except OSError as err:
        raise OSError(
            f"could not load --model.policy.model_name_or_path={name_or_path!r} ({err}). With local_files_only=True the "
            "weights must already be on disk: download them on a machine with internet access and point the flag at "
            "that directory."
        ) from err
    if processor.tokenizer.pad_token_id is None:
        processor.tokenizer.pad_token = processor.tokenizer.eos_token
    processor.tokenizer.padding_side = "left"
    return model, processor
