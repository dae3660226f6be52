"""The checks a GRPO fit makes of its trainer before it starts: which strategies and precisions the step's many
policy calls (rollout, reference, micro-batches) and its engines support. Each failure names the flag to change."""

from __future__ import annotations

import lightning as L

from lightning_modules.engines.base import RolloutEngine, UpdateEngine
from lightning_modules.models import fsdp

__all__ = ["check_strategy"]


def check_strategy(trainer: L.Trainer, rollout_engine: RolloutEngine, update_engine: UpdateEngine) -> None:
    """Raise a ValueError naming the flag when ``trainer``'s strategy or precision does not fit the GRPO step or the
    module's engines (FSDP1, tensor parallelism, FSDP2 without fp32 master shards, with a compiled decode step or with
    an update engine that runs the model's sub-modules itself, autocast over engines that run in the weights' dtype, a
    single-process update engine under DDP)."""
    strategy = type(trainer.strategy).__name__
    if "FSDP" in strategy and not isinstance(trainer.strategy, fsdp.ModelParallelStrategy):
        raise ValueError(
            f"--trainer.strategy {strategy} (FSDP1) wraps the module in one FSDP forward, but a GRPO step "
            "calls the policy many times (rollout, reference, micro-batches): use --trainer.strategy fsdp2 "
            "(FSDP2, lightning_modules/models/fsdp.py) or ddp"
        )
    if isinstance(trainer.strategy, fsdp.ModelParallelStrategy):
        tp = trainer.strategy._tensor_parallel_size
        if tp not in (1, "auto") or (tp == "auto" and trainer.strategy.num_processes > 1):
            raise ValueError(
                "the policy implements no tensor parallelism: use --trainer.strategy fsdp2 (every process shards "
                "the policy) instead of ModelParallelStrategy with tensor_parallel_size > 1"
            )
        if str(trainer.precision) != "32-true":
            raise ValueError(
                f"--trainer.precision {trainer.precision} with FSDP2 would cast the fp32 master shards: use "
                "--trainer.precision 32-true; the compute dtype is --model.policy.dtype (bf16: gathered in bf16, "
                "gradients reduced in fp32)"
            )
        if update_engine.own_kernels:
            raise ValueError(
                f"--model.engines.update_engine {update_engine.name} runs the vision tower and the decoder layers "
                "itself, past FSDP2's root unit, whose parameters (the patch embedding, the embeddings, the merger) "
                "then stay sharded and whose gradients are never reduced: use --model.engines.update_engine hf with "
                "--trainer.strategy fsdp2"
            )
        if rollout_engine.compile_step:
            raise ValueError(
                "--model.engines.rollout_compile compiles the fast engine's decode step once per process, but under "
                "FSDP2 that step is rebuilt after every rollout (the gathered parameters it reads are freed), so "
                "it would recompile every step: set --model.engines.rollout_compile false with --trainer.strategy fsdp2"
            )
    plugin = type(trainer.precision_plugin).__name__
    engines = [e.name for e in (rollout_engine, update_engine) if e.own_kernels]
    if plugin == "MixedPrecision" and engines:
        raise ValueError(
            f"--trainer.precision {trainer.precision} (autocast over fp32 weights) does not drive the "
            f"{' and '.join(engines)} engine(s), which run in the weights' dtype: use --trainer.precision "
            "bf16-true with --model.policy.dtype bf16 (fp32 master weights are on by default: --model.optimisation.master_weights "
            "fp32), or --model.engines.rollout_engine hf --model.engines.update_engine hf"
        )
    if not update_engine.distributed_ok and trainer.world_size > 1:
        raise ValueError(
            f"--model.engines.update_engine {update_engine.name} is single-process only (its deferred vision "
            "backward is not DDP-aware): use --model.engines.update_engine hf with several GPUs"
        )
