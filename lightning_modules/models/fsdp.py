"""FSDP2 (``torch.distributed.fsdp.fully_shard``) for the GRPO policy and its frozen reference.

Why FSDP2 through Lightning's ``ModelParallelStrategy`` and not ``FSDPStrategy``: ``FSDPStrategy`` wraps the whole
LightningModule in FSDP1 (flat parameters, one root forward), while a GRPO step calls the policy many times outside
one forward (a rollout with hundreds of decode steps, the reference and old log-probs, a forward + backward per
micro-batch). FSDP2 puts its all-gather / free hooks on each sharded sub-module, so every call of the policy works on
its own, and its parameters are ``DTensor`` shards that the optimizer steps directly. ``ModelParallelStrategy`` lets
the module apply ``fully_shard`` itself in ``configure_model`` and saves distributed checkpoints (one folder, a shard
per rank). `FSDP2Strategy` is that strategy with the whole world as the data-parallel (sharding) dimension and no
tensor parallelism; ``--trainer.strategy fsdp2`` selects it.

Numerics (what ``--model.policy.dtype bf16`` means under FSDP2): the policy is loaded in **fp32** and its fp32 shards are
the master weights the optimizer steps (AdamW state fp32); ``MixedPrecisionPolicy(param_dtype=bf16,
reduce_dtype=fp32)`` all-gathers bf16 copies for every forward and backward and reduce-scatters gradients in fp32.
So ``precision.MasterWeightOptimizer`` is not used (nothing is below fp32), and ``--trainer.precision`` must be
``32-true`` (``bf16-true`` would cast the masters to bf16). Memory per trainable parameter: (4 B master + 4 B
gradient + 8 B AdamW) / world size, plus one bf16 layer gathered at a time.

Units: each decoder layer of the language model and each vision block is one ``fully_shard`` unit; the root unit
holds the rest (embeddings and the tied LM head, the final norm, the patch embedding, the merger). The frozen
reference is sharded the same way with its parameters stored in the compute dtype (they are never stepped), or with
its shards offloaded to CPU (``CPUOffloadPolicy``: gathered to the GPU layer by layer at each reference forward).

Rollouts (``--model.engines.rollout_gather``): ``once`` (`gathered`) gathers the full compute-dtype parameters once per
rollout and keeps them for all its decode steps, then frees them: nothing collective runs during generation, so ranks
may stop at different lengths and every rollout engine (``hf``, ``fast``) runs unchanged; the price is one full bf16
copy of the policy during the rollout (7B: ~17 GB). ``per_layer`` gathers only the root unit for the rollout and each
layer inside every decode step through the normal forward: little extra memory, but (layers + blocks) all-gathers per
generated token, and every rank must run the same number of decode steps (`needs_lockstep`: HF's ``synced_gpus``);
only the ``hf`` engine goes through the normal forward (the ``fast`` engine calls the layers' sub-modules itself).
"""

from __future__ import annotations

import contextlib
import re
import secrets
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from lightning.pytorch.strategies import ModelParallelStrategy, StrategyRegistry
from torch import nn

from core.checkpoint_files import checksums, leftovers, remove, staging_path, switch, write_manifest

_SHARD = re.compile(r"__(\d+)_")
"""A DCP shard file name, ``__<writing rank>_<n>.distcp``."""


class FSDP2Strategy(ModelParallelStrategy):
    """``ModelParallelStrategy`` with every process in one data-parallel (sharding) group and no tensor parallelism:
    the strategy's own defaults would make the GPUs of a node one tensor-parallel group, which the policy does not
    implement. Checkpoints are distributed (a folder with one shard per rank, written beside the previous one and
    switched in when complete: `save_checkpoint`) unless ``save_distributed_checkpoint`` is false (then rank 0
    gathers one full file)."""

    def __init__(self, save_distributed_checkpoint: bool = True, **kwargs) -> None:
        super().__init__(
            data_parallel_size="auto",
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            **kwargs,
        )

    def setup_environment(self) -> None:
        self._data_parallel_size = self.num_nodes * self.num_processes
        super().setup_environment()

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Any = None) -> None:
        """A distributed checkpoint is written into a staging folder beside ``filepath`` and switched into place only
        once every rank has written its shard and rank 0 ``meta.pt`` and the checksums of every file
        (``checksums.json``, verified before a resume): a kill mid-save (minutes for a 7B run) leaves the previous
        checkpoint whole and a staging folder that the next save removes (core/checkpoint_files.py). A single
        file (``save_distributed_checkpoint=False``) is Lightning's own atomic save."""
        if not self._save_distributed_checkpoint:
            return super().save_checkpoint(checkpoint, filepath, storage_options)

        # every rank writes into the same staging folder: rank 0 names it
        final, token = self.broadcast((str(filepath), secrets.token_hex(4)))
        final = Path(final)
        staging = staging_path(final, token)
        self._write_staging(checkpoint, staging, storage_options)
        self.barrier("FSDP2Strategy.save_checkpoint: written")
        sums = self._checksums(staging)
        if self.global_rank == 0:
            write_manifest(staging, sums)  # the last file: checked at load, so a shard's changed bytes are found
            switch(staging, final)
        self.barrier("FSDP2Strategy.save_checkpoint: switched")

    def _checksums(self, staging: Path) -> dict[str, list]:
        """The CRC-32 of every file of the staging folder, each rank reading the shards it wrote (DCP names them
        ``__<rank>_<n>.distcp``: just written, they are likely in its page cache, and no rank reads another's over a
        network filesystem) and rank 0 the rest; rank 0 lists the files (one listing, whatever a network filesystem's
        directory cache shows the others) and receives every rank's sums."""
        import torch.distributed as dist

        names = self.broadcast(sorted(p.name for p in staging.iterdir()) if self.global_rank == 0 else None)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return checksums(staging, names)
        rank, world = dist.get_rank(), dist.get_world_size()
        own = [n for n in names if (int(m[1]) % world if (m := _SHARD.match(n)) else 0) == rank]
        shares: list[Any] = [None] * world
        dist.all_gather_object(shares, checksums(staging, own))
        return {name: s for share in shares for name, s in share.items()}

    def _write_staging(self, checkpoint: dict[str, Any], staging: Path, storage_options: Any = None) -> None:
        super().save_checkpoint(checkpoint, staging, storage_options)

    def remove_checkpoint(self, filepath: Any) -> None:
        """Also removes what a killed save of ``filepath`` left behind (ModelCheckpoint's ``save_top_k``)."""
        super().remove_checkpoint(filepath)
        if self.global_rank == 0:
            for p in leftovers(Path(filepath)):
                remove(p)


if "fsdp2" not in StrategyRegistry:
    StrategyRegistry.register(
        "fsdp2", FSDP2Strategy, description="FSDP2 (fully_shard) over every process, distributed checkpoints"
    )


def sharding_mesh(trainer) -> object | None:
    """The data-parallel device mesh to shard over when ``trainer`` runs a ``ModelParallelStrategy``, else ``None``."""
    if trainer is None or not isinstance(trainer.strategy, ModelParallelStrategy):
        return None
    return trainer.strategy.device_mesh["data_parallel"]


def shard_units(model: nn.Module) -> list[nn.Module]:
    """The sub-modules that become one ``fully_shard`` unit each: the language model's decoder layers and the vision
    tower's blocks (Qwen2-VL family)."""
    inner = getattr(model, "model", model)
    units: list[nn.Module] = []
    for path in ("language_model.layers", "visual.blocks"):
        mod = inner
        for name in path.split("."):
            mod = getattr(mod, name, None)
            if mod is None:
                break
        if mod is not None:
            units.extend(mod)
    if not units:
        raise ValueError(
            f"{type(model).__name__} has no model.language_model.layers / model.visual.blocks: FSDP2 sharding "
            "knows the Qwen2-VL family's layout only; train this model with --trainer.strategy ddp or on one GPU"
        )
    return units


def shard(
    model: nn.Module,
    mesh,
    *,
    compute_dtype: torch.dtype,
    offload: bool = False,
) -> nn.Module:
    """``fully_shard`` each unit of ``model`` and then its root, in place (returns ``model``).

    ``compute_dtype`` below the parameters' dtype gathers the parameters in it (``MixedPrecisionPolicy.param_dtype``)
    with gradients reduced in fp32; ``offload`` keeps the shards on CPU (``CPUOffloadPolicy``)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    stored = next(model.parameters()).dtype
    mp = MixedPrecisionPolicy(
        param_dtype=compute_dtype if compute_dtype != stored else None, reduce_dtype=torch.float32
    )
    kwargs = dict(
        mesh=mesh,
        mp_policy=mp,
        # pinned host shards copy to the GPU asynchronously; a CPU run (tests) has nothing to pin
        offload_policy=CPUOffloadPolicy(pin_memory=torch.cuda.is_available()) if offload else OffloadPolicy(),
    )
    for unit in shard_units(model):
        fully_shard(unit, reshard_after_forward=True, **kwargs)
    fully_shard(model, reshard_after_forward=False, **kwargs)  # the root's few tensors stay gathered after forward
    return model


def is_sharded(model: nn.Module | None) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@contextlib.contextmanager
def gathered(
    model: nn.Module | None, *, layers: bool = True, release: Callable[[nn.Module], None] | None = None
) -> Iterator[None]:
    """Inside, the parameters of a sharded ``model`` are gathered (compute dtype) and stay so across forwards: with
    ``layers`` all of them (a rollout's decode steps run no collective), without only the root unit's (embeddings, LM
    head, patch embedding, merger: what ``generate`` also uses outside the model's forward; each layer then gathers in
    its own forward). Outside, the shards are back. A no-op for a model that is not sharded.

    ``release(model)`` runs before the gathered parameters are freed: the rollout engine's
    (`RolloutEngine.release`; the fast engine's cached decode step, its CUDA graph, points at them).

    Every rank must enter together (the gather is a collective), and nothing may take a gradient inside."""
    if not is_sharded(model):
        yield
        return
    from torch.distributed.fsdp import FSDPModule

    # the root must be initialised as the root before any unit runs alone (the fast engine calls the decoder layers
    # directly, and the first unit to run forward otherwise takes itself for the root)
    model._get_fsdp_state()._lazy_init()
    units = [m for m in model.modules() if isinstance(m, FSDPModule)] if layers else [model]
    for m in units:
        m.set_reshard_after_forward(False, recurse=False)
        m.unshard()
    try:
        yield
    finally:
        if release is not None:
            release(model)
        for m in units:
            m.reshard()
            m.set_reshard_after_forward(m is not model, recurse=False)  # as `shard` set them


def needs_lockstep(model: nn.Module) -> bool:
    """True when ``model``'s parameters are sharded right now (not inside `gathered`) over several processes: each
    forward then all-gathers, so every rank must run the same number of forwards (HF ``generate(synced_gpus=True)``
    keeps the ranks that finished decoding stepping until all have)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    if not is_sharded(model) or not dist.is_initialized() or dist.get_world_size() == 1:
        return False
    return any(isinstance(p, DTensor) for p in model.parameters())


def full_value(t: torch.Tensor) -> torch.Tensor:
    """A plain tensor of ``t`` (a ``DTensor``, e.g. the gradient norm of sharded parameters, is gathered)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of ``model`` as full CPU tensors (a sharded model's are gathered: every rank must
    call it; all ranks receive the full tensors)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not is_sharded(model):
        return model.state_dict()
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
