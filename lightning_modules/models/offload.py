"""fp32-master AdamW with its state in host memory, stepped on the device in chunks (``--model.optimisation.offload``).

Why: `precision.MasterWeightOptimizer` keeps 18 B per trainable parameter on the GPU (bf16 weight 2, fp32 master 4,
fp32 gradient 4, AdamW moments 8): 60 GB for the 3.75B parameters of the 3B recipe before the reference and the
activations, so no paper config fits an 80 GB card, and the 7B's 8.29B parameters need 149 GB. DeepSpeed's ZeRO-Offload
and torchao's ``CPUOffloadOptimizer`` move the optimizer state to host memory; this module does the same and keeps the
step on the GPU:

* ``moments``: the fp32 masters stay on the device, the AdamW moments (8 B per parameter) live in pinned host memory;
* ``masters``: the masters move to host memory too (12 B per parameter off the device);
* the fp32 gradients stay on the device in both, accumulated there in fp32 as today (the same hook on each bf16
  parameter), so gradient clipping (`precision.optimizer_tensors`) sees the same tensors and values;
* the step walks the parameters in chunks of ``chunk_numel`` elements: the chunk's host state is copied to the device,
  stepped with torch's own Adam / AdamW function (``torch.optim.adam.adam``: the same maths, the same foreach choice
  as ``torch.optim.AdamW.step`` on those tensors), copied back, and the bf16 parameters are refreshed from the stepped
  masters. The next chunk's host -> device copy runs on a side CUDA stream while the current chunk is stepped; on the
  CPU the same code runs in order.

The numerics are those of fp32-master AdamW (tests/lightning_modules/test_offload.py: bitwise on the CPU). The
``state_dict`` is the one `MasterWeightOptimizer` writes (``{"inner": AdamW's state_dict, "masters": [...]}``, or
AdamW's own when no parameter is below fp32), so a run resumes with offload on or off.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
from torch import nn
from torch.optim.adam import adam

from lightning_modules.models.precision import OptimizerFactory, accumulate_into, build_optimizer

Offload = Literal["none", "moments", "masters"]
GIB = 2**30
MEMINFO = Path("/proc/meminfo")


@dataclass
class _Slot:
    """One trainable parameter: its fp32 gradient lives on ``carrier`` (in ``param_groups``), its master on the
    device (``master``) or in host memory (``host_master``), its moments in host memory."""

    param: nn.Parameter  # the model's tensor (bf16, or the fp32 master itself)
    carrier: nn.Parameter  # holds the fp32 gradient on the device; the optimizer's param_groups list it
    master: torch.Tensor | None  # the fp32 master on the device (None: in host memory)
    host_master: torch.Tensor | None
    moments: dict[str, torch.Tensor]  # exp_avg, exp_avg_sq (+ max_exp_avg_sq): host memory
    step: torch.Tensor | None = None  # AdamW's step count (a CPU scalar, as torch keeps it); None before the first

    @property
    def low(self) -> bool:
        return self.param.dtype != torch.float32


def mem_available() -> int | None:
    """MemAvailable of ``/proc/meminfo`` in bytes (None where the file does not exist)."""
    try:
        for line in MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def host_bytes(params: Iterable[nn.Parameter], offload: Offload, amsgrad: bool = False) -> dict[str, int]:
    """Host memory that ``offload`` pins for ``params``: ``{"masters": B, "moments": B}`` (fp32 masters only for the
    parameters below fp32 and only under ``masters``; AdamW's two fp32 moments, three with amsgrad, for all)."""
    params = [p for p in params if p.requires_grad]
    low = sum(p.numel() for p in params if p.dtype != torch.float32)
    return {
        "masters": 4 * low if offload == "masters" else 0,
        "moments": (12 if amsgrad else 8) * sum(p.numel() for p in params),
    }


def check_host_memory(need: dict[str, int], offload: Offload, available: int | None) -> str:
    """The line printed at start (what is pinned, of how much available), or a one-line ``ValueError`` when the host
    has too little (naming the setting that lowers it)."""
    total = sum(need.values())
    parts = f"fp32 masters {need['masters'] / GIB:.1f} + AdamW moments {need['moments'] / GIB:.1f} GiB"
    if available is not None and total > available:
        lower = (
            f"--model.optimisation.offload moments (keeps the masters on the GPU: {need['moments'] / GIB:.1f} GiB of "
            "host memory)"
            if offload == "masters"
            else "--model.optimisation.offload none (all optimizer state on the GPU)"
        )
        raise ValueError(
            f"--model.optimisation.offload {offload} pins {total / GIB:.1f} GiB of host memory ({parts}) but the host "
            f"has {available / GIB:.1f} GiB available (MemAvailable, /proc/meminfo): use {lower}, or a host with more "
            "memory"
        )
    of = f" of {available / GIB:.1f} GiB available" if available is not None else ""
    return f"offload {offload}: pinning {total / GIB:.1f} GiB of host memory ({parts}){of}"


class OffloadedAdamW(torch.optim.Optimizer):
    """fp32-master Adam / AdamW whose masters (``masters``) and / or moments (``moments``) live in host memory and
    whose step streams them through the device in chunks (module docstring).

    ``params``: the model's trainable parameters; ``factory`` builds the Adam / AdamW whose hyper-parameters (and
    ``param_groups``, which LR schedulers change) this optimizer uses; it never steps itself.
    ``accumulate_in_fp32``: as in `MasterWeightOptimizer` (off under DDP: the reduced gradient is copied at ``step``).
    ``chunk_numel``: elements per streamed chunk (device scratch: 12 B per element under ``masters``, 8 under
    ``moments``, two chunks in flight).
    ``mem_available``: the host's available memory in bytes (the check before pinning; default ``/proc/meminfo``).
    """

    def __init__(
        self,
        params: Iterable[nn.Parameter],
        factory: OptimizerFactory,
        *,
        offload: Literal["moments", "masters"],
        accumulate_in_fp32: bool = True,
        chunk_numel: int = 2**25,
        mem_available: Callable[[], int | None] = mem_available,
    ):
        params = [p for p in params if p.requires_grad]
        if offload not in ("moments", "masters"):
            raise ValueError(f"--model.optimisation.offload must be moments or masters here, got {offload!r}")
        self.offload = offload
        self.chunk_numel = chunk_numel
        self.device = params[0].device if params else torch.device("cpu")
        carriers = [self._carrier(p) for p in params]
        self.inner = factory([c for c, _ in carriers])
        self._check_inner()
        amsgrad = any(g["amsgrad"] for g in self.param_groups)
        need = host_bytes(params, offload, amsgrad)
        print(check_host_memory(need, offload, mem_available()), flush=True)
        pin = self.device.type == "cuda"
        self._slots: dict[int, _Slot] = {}  # by id(carrier)
        for p, (carrier, master) in zip(params, carriers):
            host_master = None
            if offload == "masters" and p.dtype != torch.float32:
                host_master = torch.empty(p.shape, dtype=torch.float32, pin_memory=pin)
                host_master.copy_(p.detach())
            names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if amsgrad else ("exp_avg", "exp_avg_sq")
            moments = {k: torch.zeros(p.shape, dtype=torch.float32, pin_memory=pin) for k in names}
            self._slots[id(carrier)] = _Slot(p, carrier, master, host_master, moments)
        self.accumulate_in_fp32 = accumulate_in_fp32
        self._hooks = []
        if accumulate_in_fp32:
            for s in self._low():
                self._hooks.append(s.param.register_post_accumulate_grad_hook(accumulate_into(s.carrier)))
        self._copy_stream = torch.cuda.Stream(self.device) if pin else None

    def _carrier(self, p: nn.Parameter) -> tuple[nn.Parameter, torch.Tensor | None]:
        """(the tensor the gradient accumulates on, the device master or None). An fp32 parameter is its own master and
        carrier; a low-precision one gets an fp32 master on the device (``moments``), or (``masters``) a stand-in of
        4 bytes broadcast to the parameter's shape, whose ``.grad`` is the full fp32 gradient."""
        if not p.is_contiguous():
            raise ValueError(
                "--model.optimisation.offload streams flat views of each parameter: a parameter is not contiguous"
            )
        if p.dtype == torch.float32:
            return p, p
        if self.offload == "moments":
            m = nn.Parameter(p.detach().float().clone(), requires_grad=True)
            return m, m
        stand_in = torch.zeros((), dtype=torch.float32, device=p.device).expand(p.shape)
        return nn.Parameter(stand_in, requires_grad=True), None

    def _check_inner(self) -> None:
        if not isinstance(self.inner, torch.optim.Adam):  # AdamW is an Adam with decoupled weight decay
            raise ValueError(
                f"--model.optimisation.offload steps Adam / AdamW, but --model.optimizer is {type(self.inner).__name__}"
                ": use torch.optim.AdamW, or --model.optimisation.offload none"
            )
        for g in self.param_groups:
            if g.get("fused") or g.get("capturable") or g.get("differentiable"):
                raise ValueError(
                    "--model.optimisation.offload runs torch's foreach / single-tensor AdamW on each chunk: set "
                    "fused, capturable and differentiable of --model.optimizer to false"
                )

    # the inner optimizer's view (torch.optim.Optimizer sets these in __init__, which this wrapper does not call)
    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return self.inner.param_groups

    @property
    def state(self) -> dict:
        """Empty: the moments live in host memory (``state_dict`` has them). Lightning moves every tensor of
        ``optimizer.state`` to the GPU after a resume, which would undo the offload."""
        return {}

    @property
    def defaults(self) -> dict[str, Any]:
        return self.inner.defaults

    @property
    def masters(self) -> list[torch.Tensor]:
        """The fp32 masters in parameter order (device or host tensors)."""
        return [s.master if s.master is not None else s.host_master for s in self._slots.values()]

    @property
    def num_low_precision(self) -> int:
        return len(self._low())

    def _low(self) -> list[_Slot]:
        return [s for s in self._slots.values() if s.low]

    def __repr__(self) -> str:
        return f"OffloadedAdamW(offload={self.offload}, {len(self._slots)} tensors, {self.inner!r})"

    def __getstate__(self):
        d = dict(self.__dict__)
        d["_hooks"], d["_copy_stream"] = [], None
        return d

    # ------------------------------------------------------------------------------------------------------ the step
    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for s in self._low():
            if s.param.grad is not None:  # not moved by the hook (DDP, or a gradient set by hand)
                g = s.param.grad
                s.carrier.grad = g.float() if s.carrier.grad is None else s.carrier.grad.add_(g)
                s.param.grad = None
        for group in self.param_groups:
            slots = [self._slots[id(c)] for c in group["params"] if c.grad is not None]
            self._step_group(group, slots)
            for s in slots:
                s.step = torch.tensor(0.0) if s.step is None else s.step
                s.step += 1
        if self._copy_stream is not None:
            torch.cuda.current_stream(self.device).synchronize()  # the host copies are complete before anyone reads
        return loss

    def _chunks(self, slots: list[_Slot]) -> list[list[tuple[_Slot, int, int]]]:
        """Consecutive (slot, start, end) element ranges, ``chunk_numel`` elements per chunk (a large parameter is
        split over several)."""
        chunks: list[list[tuple[_Slot, int, int]]] = [[]]
        room = self.chunk_numel
        for s in slots:
            start, n = 0, s.param.numel()
            while start < n:
                if room == 0:
                    chunks.append([])
                    room = self.chunk_numel
                end = min(n, start + room)
                chunks[-1].append((s, start, end))
                room -= end - start
                start = end
        return [c for c in chunks if c]

    def _load(self, chunk: list[tuple[_Slot, int, int]]) -> tuple[list[dict[str, torch.Tensor]], Any]:
        """The chunk's host state on the device (on the side stream under CUDA), and the event that marks it there."""
        stream = self._copy_stream
        ctx = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        pieces = []
        with ctx:
            for s, a, b in chunk:
                host = dict(s.moments)
                if s.host_master is not None:
                    host["master"] = s.host_master
                pieces.append(
                    {k: t.view(-1)[a:b].to(self.device, non_blocking=True, copy=True) for k, t in host.items()}
                )
            event = stream.record_event() if stream is not None else None
        return pieces, event

    def _step_group(self, group: dict[str, Any], slots: list[_Slot]) -> None:
        chunks = self._chunks(slots)
        compute = torch.cuda.current_stream(self.device) if self._copy_stream is not None else None
        if self._copy_stream is not None:
            self._copy_stream.wait_stream(compute)  # gradients (clipped) and the last step's host copies are done
        nxt = self._load(chunks[0]) if chunks else None
        for i, chunk in enumerate(chunks):
            pieces, event = nxt
            if event is not None:
                compute.wait_event(event)
                for piece in pieces:
                    for t in piece.values():
                        t.record_stream(compute)
            nxt = self._load(chunks[i + 1]) if i + 1 < len(chunks) else None  # overlaps this chunk's step
            self._adam(group, chunk, pieces)
            for (s, a, b), piece in zip(chunk, pieces):
                for k, t in s.moments.items():
                    t.view(-1)[a:b].copy_(piece[k], non_blocking=True)
                master = piece["master"] if "master" in piece else s.master.view(-1)[a:b]
                if s.host_master is not None:
                    s.host_master.view(-1)[a:b].copy_(master, non_blocking=True)
                if s.low:
                    s.param.view(-1)[a:b].copy_(master)  # round to nearest, as MasterWeightOptimizer._refresh

    def _adam(self, group: dict[str, Any], chunk: list[tuple[_Slot, int, int]], pieces: list[dict]) -> None:
        """torch's Adam / AdamW function on the chunk's device tensors (each piece's step count is a copy: a parameter
        split over chunks counts one step)."""
        params, grads, steps = [], [], []
        for (s, a, b), piece in zip(chunk, pieces):
            params.append(piece["master"] if "master" in piece else s.master.view(-1)[a:b])
            grads.append(s.carrier.grad.view(-1)[a:b])
            steps.append(torch.tensor(0.0) if s.step is None else s.step.clone())
        beta1, beta2 = group["betas"]
        adam(
            params,
            grads,
            [p["exp_avg"] for p in pieces],
            [p["exp_avg_sq"] for p in pieces],
            [p["max_exp_avg_sq"] for p in pieces] if group["amsgrad"] else [],
            steps,
            amsgrad=group["amsgrad"],
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            weight_decay=group["weight_decay"],
            eps=group["eps"],
            maximize=group["maximize"],
            foreach=group["foreach"],
            decoupled_weight_decay=group.get("decoupled_weight_decay", False),
        )

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.inner.zero_grad(set_to_none=set_to_none)
        for s in self._low():
            s.param.grad = None

    # ------------------------------------------------------------------------------------------------ checkpoints
    def _index(self) -> dict[int, _Slot]:
        """AdamW's state_dict index (the position over all param_groups) -> slot."""
        flat = [c for g in self.param_groups for c in g["params"]]
        return {i: self._slots[id(c)] for i, c in enumerate(flat)}

    def state_dict(self) -> dict[str, Any]:
        """What `MasterWeightOptimizer` (or AdamW alone, without low-precision parameters) writes."""
        inner = self.inner.state_dict()  # param_groups; its own state is empty (it never steps)
        inner["state"] = {
            i: {"step": s.step.clone(), **s.moments} for i, s in self._index().items() if s.step is not None
        }
        low = self._low()
        if not low:
            return inner
        return {"inner": inner, "masters": [s.master.detach() if s.master is not None else s.host_master for s in low]}

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        inner = state_dict.get("inner", state_dict)
        if "inner" in state_dict:
            masters, low = state_dict["masters"], self._low()
            if len(masters) != len(low):
                raise ValueError(
                    f"checkpoint holds {len(masters)} fp32 master tensors, this model has {len(low)} low-precision "
                    "trainable parameters: resume with the same --model.policy.dtype and trainable parameters"
                )
            for s, saved in zip(low, masters):
                (s.master if s.master is not None else s.host_master).copy_(saved)
                s.param.copy_(saved)
        self.inner.load_state_dict({"state": {}, "param_groups": inner["param_groups"]})
        index = self._index()
        for s in index.values():
            s.step = None
        for i, saved in inner["state"].items():
            s = index[int(i)]
            for k, t in s.moments.items():
                t.copy_(saved[k])
            s.step = torch.as_tensor(saved["step"], dtype=torch.float32).detach().clone().cpu()


def policy_optimizer(
    params: Iterable[nn.Parameter],
    factory: OptimizerFactory,
    *,
    master_weights: str,
    offload: Offload,
    distributed: bool,
) -> torch.optim.Optimizer:
    """The optimizer `GRPOModule` steps: `precision.build_optimizer` (``offload: none``), or `OffloadedAdamW`."""
    params = [p for p in params if p.requires_grad]
    if offload == "none":
        return build_optimizer(params, factory, master_weights=master_weights, distributed=distributed)
    if any(type(p.data).__name__ == "DTensor" for p in params):
        raise ValueError(
            "--model.optimisation.offload is for one process or DDP; under --trainer.strategy fsdp2 the shards are "
            "fp32 masters already (set offload none)"
        )
    return OffloadedAdamW(params, factory, offload=offload, accumulate_in_fp32=not distributed)
