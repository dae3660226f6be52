"""An out-of-memory error a user can act on: a CUDA OOM during fit ends with one line that names what the config was
measured at, the card's memory and the settings that lower the peak, with their current values.

Why: torch's message (``CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB ...``)
says what failed, not what to change; the 3B recipe needs 111 GiB as shipped and most labs have 80 GB cards. What a
config was measured at is the optional ``measured`` key (`Measured`: card, peak, s/step, from bench/e2e_gpu.py's JSON),
which the config's header comment repeats for readers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

GIB = 2**30


@dataclass(frozen=True)
class Measured:
    """What a config was measured at through ``train.py fit`` (``--measured.*``; bench/e2e_gpu.py writes the figures).

    Args:
        card: the GPU it ran on (e.g. ``H200``, ``H100 80GB``).
        peak_gib: its peak GPU memory (GiB, torch's max allocated: the step's ``peak_mem_gib``).
        s_per_step: its median step time (seconds).
        date: when (``YYYY-MM-DD``).
    """

    card: str | None = None
    peak_gib: float | None = None
    s_per_step: float | None = None
    date: str | None = None


class OutOfMemory(RuntimeError):
    """A CUDA out-of-memory error during a stage, with the one line that says what to change."""


def _get(cfg: Any, dotted: str) -> Any:
    """``cfg.a.b.c`` of a parsed config (Namespaces, dicts or objects); None where a part is missing."""
    for part in dotted.split("."):
        if cfg is None:
            return None
        cfg = cfg.get(part) if isinstance(cfg, dict) or hasattr(cfg, "get") else getattr(cfg, part, None)
    return cfg


def card_memory() -> str:
    """``NVIDIA H100 80GB HBM3 with 79.2 GiB (peak allocated 78.1 GiB)``, or that there is no CUDA device."""
    if not torch.cuda.is_available():
        return "no CUDA device visible"
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    peak = torch.cuda.max_memory_allocated() / GIB
    return f"{props.name} with {props.total_memory / GIB:.1f} GiB (peak allocated {peak:.1f} GiB)"


def _lowering(cfg: Any) -> list[str]:
    """The settings of the config's module that lower the peak, each with its flag and its value now."""
    args = "model.init_args"
    out = []
    micro = _get(cfg, f"{args}.engines.micro_batch_size")
    if isinstance(micro, int) and micro > 1:
        out.append(f"--{args}.engines.micro_batch_size {max(1, micro // 2)} (now {micro}; activations)")
    offload = _get(cfg, f"{args}.optimisation.offload")
    fsdp = str(_get(cfg, "trainer.strategy") or "").startswith("fsdp")
    if fsdp and _get(cfg, f"{args}.kl.reference_offload") is False:  # FSDP2 refuses the optimizer offload
        out.append(
            f"--{args}.kl.reference_offload true (now false; the frozen reference's shards in host memory, 2 B per "
            "parameter)"
        )
    if fsdp:
        devices = _get(cfg, "trainer.devices")
        out.append(f"--trainer.devices (now {devices}; FSDP2 shards the fp32 masters, gradients and AdamW state)")
    elif offload in ("none", "moments") and _get(cfg, f"{args}.optimisation.master_weights") != "none":
        to = "moments or masters" if offload == "none" else "masters"
        out.append(
            f"--{args}.optimisation.offload {to} (now {offload}; the AdamW moments, then the fp32 masters, in host "
            "memory: 8 and 4 B per parameter)"
        )
    if _get(cfg, f"{args}.engines.vision_checkpointing") is False:
        out.append(
            f"--{args}.engines.vision_checkpointing true (now false; the vision tower's activations, with "
            f"--{args}.engines.update_engine packed)"
        )
    if _get(cfg, f"{args}.policy.gradient_checkpointing") is False:
        out.append(f"--{args}.policy.gradient_checkpointing true (now false)")
    return out


def oom_line(cfg: Any, stage: str, card: str | None = None) -> str:
    """The one line for an out-of-memory error during ``stage`` of the parsed config ``cfg``."""
    measured = _get(cfg, "measured")
    peak = _get(measured, "peak_gib")
    if peak is not None:
        on = _get(measured, "card")
        seen = f"the config was measured at a peak of {peak:.1f} GiB{f' on {on}' if on else ''} (--measured)"
    else:
        seen = "the config states no measured peak (--measured.peak_gib)"
    settings = _lowering(cfg)
    lower = f"; lower the peak with {', '.join(settings)}" if settings else ""
    return f"CUDA out of memory during {stage} on {card or card_memory()}; {seen}{lower}; docs/performance.md"
