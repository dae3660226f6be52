"""fp32 master weights for a policy that computes in bf16.

The paper configs train at lr 1e-6. A bf16 weight of magnitude 0.02 has a spacing of 2^-8 * 0.0156 = 6.1e-5 between
representable values, so an AdamW update of ~1e-6 rounds away: ten steps on a bf16 1024 x 1024 weight change about 2%
of its entries (fp32: all). verl (FSDP mixed precision) and DeepSpeed's bf16 optimizer keep an fp32 copy of every
trainable weight for the optimizer; this module does the same for a single process or DDP:

* the model keeps its bf16 parameters, so every forward, backward and both fast engines (`decode.fast_generate`,
  `packing.policy_backward`) run in the compute dtype on the same tensors they always used;
* the optimizer holds an fp32 **master** copy of each low-precision trainable parameter and its state (AdamW's
  moments) in fp32;
* gradients are accumulated in fp32: a hook on each bf16 parameter adds its freshly accumulated bf16 gradient into
  the master's fp32 gradient and frees it (so the micro-batches of a step sum in fp32; under DDP the hook is off,
  because DDP's reducer reads ``param.grad`` after accumulation, and the all-reduced bf16 gradient is copied once
  before the step);
* after each step the bf16 parameters are refreshed from the masters (round to nearest), so the next rollout
  samples from the updated policy.

Memory per trainable parameter (single process): 2 B bf16 weight + 4 B master + 4 B fp32 gradient + 8 B AdamW
moments = 18 B (bf16 AdamW without masters: 8 B). docs/performance.md has the per-model-size table.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

OptimizerFactory = Callable[[Iterable[torch.Tensor]], torch.optim.Optimizer]


class MasterWeightOptimizer(torch.optim.Optimizer):
    """Wraps an optimizer so that it steps fp32 masters of low-precision parameters.

    ``params``: the model's trainable parameters (any dtype; fp32 ones are stepped in place, without a copy).
    ``factory``: builds the inner optimizer from the masters (e.g. LightningCLI's ``optimizer`` callable).
    ``accumulate_in_fp32``: move each gradient into the master's fp32 gradient as soon as it is accumulated (single
    process); off under DDP, where the reduced low-precision gradient is copied once at ``step``.

    ``param_groups`` and ``state`` are the inner optimizer's (LR schedulers and Lightning see the masters);
    ``state_dict`` holds the inner state and the masters, so a resumed run continues from the same fp32 weights.
    """

    def __init__(self, params: Iterable[nn.Parameter], factory: OptimizerFactory, *, accumulate_in_fp32: bool = True):
        self.model_params = [p for p in params if p.requires_grad]
        self.masters: list[torch.Tensor] = []
        self._low: list[tuple[nn.Parameter, torch.Tensor]] = []  # (low-precision param, its fp32 master)
        for p in self.model_params:
            if p.dtype == torch.float32:
                self.masters.append(p)
                continue
            m = nn.Parameter(p.detach().float().clone(), requires_grad=True)
            self.masters.append(m)
            self._low.append((p, m))
        self.inner = factory(self.masters)
        self.accumulate_in_fp32 = accumulate_in_fp32
        self._hooks = []
        if accumulate_in_fp32:
            for p, m in self._low:
                self._hooks.append(p.register_post_accumulate_grad_hook(accumulate_into(m)))

    # the inner optimizer's view (torch.optim.Optimizer sets these in __init__, which this wrapper does not call)
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self):
        return self.inner.state

    @property
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    @property
    def num_low_precision(self) -> int:
        return len(self._low)

    def __repr__(self) -> str:
        return f"MasterWeightOptimizer(fp32 masters for {len(self._low)} low-precision tensors, {self.inner!r})"

    def __getstate__(self):  # hooks hold closures; a pickled optimizer (rare) carries its tensors only
        d = dict(self.__dict__)
        d["_hooks"] = []
        return d

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for p, m in self._low:
            if p.grad is not None:  # not moved by the hook (DDP, or a gradient set by hand)
                m.grad = p.grad.float() if m.grad is None else m.grad.add_(p.grad)
                p.grad = None
        self.inner.step()
        self._refresh()
        return loss

    @torch.no_grad()
    def _refresh(self) -> None:
        for p, m in self._low:
            p.copy_(m)  # round to nearest

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for p, _ in self._low:
            p.grad = None

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict(), "masters": [m.detach().clone() for _, m in self._low]}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if "inner" not in state_dict:  # a checkpoint written without masters: keep the fresh fp32 copies
            self.inner.load_state_dict(state_dict)
            return
        masters = state_dict["masters"]
        if len(masters) != len(self._low):
            raise ValueError(
                f"checkpoint holds {len(masters)} fp32 master tensors, this model has {len(self._low)} low-precision "
                "trainable parameters: resume with the same --model.policy.dtype and trainable parameters"
            )
        for (_, m), saved in zip(self._low, masters):
            m.copy_(saved)
        self.inner.load_state_dict(state_dict["inner"])
        self._refresh()


def accumulate_into(master: torch.Tensor):
    """A post-accumulate-grad hook that moves a parameter's gradient into ``master.grad`` (fp32) and frees it."""

    def hook(p: torch.Tensor) -> None:
        if p.grad is None:
            return
        if master.grad is None:
            master.grad = p.grad.float()
        else:
            master.grad.add_(p.grad)
        p.grad = None

    return hook


def optimizer_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors an optimizer steps (the masters under ``MasterWeightOptimizer``; the fp32 gradients' carriers under
    ``offload.OffloadedAdamW``): what gradient clipping sees."""
    opt = getattr(optimizer, "optimizer", optimizer)  # unwrap LightningOptimizer
    return [p for g in opt.param_groups for p in g["params"]]


def build_optimizer(
    params: Iterable[nn.Parameter], factory: OptimizerFactory, *, master_weights: str, distributed: bool
) -> torch.optim.Optimizer:
    """``factory(params)``, or the same inside a ``MasterWeightOptimizer`` when ``master_weights == "fp32"`` and some
    trainable parameter is below fp32 (fp32 parameters need no copy)."""
    params = [p for p in params if p.requires_grad]
    if master_weights == "none" or all(p.dtype == torch.float32 for p in params):
        return factory(params)
    if master_weights != "fp32":
        raise ValueError(f"--model.optimisation.master_weights must be 'fp32' or 'none', got {master_weights!r}")
    return MasterWeightOptimizer(params, factory, accumulate_in_fp32=not distributed)


@contextlib.contextmanager
def fp32_default_dtype():
    """Run with torch's default dtype at fp32 (also usable as a decorator).

    Lightning's ``bf16-true`` sets the default dtype to bf16 around every step, so a ``torch.tensor([...])`` of box
    coordinates, rewards or log-prob buffers would silently become bf16 (637.3 -> 636). The policy's precision is the
    module's business (its ``dtype`` and fp32 master weights); rewards, metrics and the objective stay fp32.
    """
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)
    try:
        yield
    finally:
        torch.set_default_dtype(old)
