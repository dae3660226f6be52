"""Optimizer state in host memory (``--model.optimisation.offload``): the same fp32-master AdamW trajectory, bitwise on
the CPU, as `MasterWeightOptimizer`, the same checkpoint, and a one-line error when the host has too little memory."""

from __future__ import annotations

import pytest
import torch
from test_grpo import _args  # the tiny GRPO run's flags (tests/ is on sys.path under pytest)
from torch import nn

from lightning_modules.grpo.args import OptimArgs
from lightning_modules.models.offload import GIB, OffloadedAdamW, check_host_memory, host_bytes, policy_optimizer
from lightning_modules.models.precision import MasterWeightOptimizer, optimizer_tensors
from train import cli_main

STEPS = 5


def _model(seed: int = 0) -> nn.Module:
    """bf16 Linear layers (masters) and an fp32 LayerNorm (its own master): both kinds of slot."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(24, 40), nn.Linear(40, 16, bias=False)).to(torch.bfloat16)
    m.append(nn.LayerNorm(16))  # fp32
    return m


def _adamw(params):
    return torch.optim.AdamW(params, lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))


def _build(model: nn.Module, offload: str, chunk_numel: int = 100) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if offload == "none":
        return MasterWeightOptimizer(params, _adamw)
    # 100 elements per chunk: the 960-element weight spans ten chunks, several parameters share one
    return OffloadedAdamW(params, _adamw, offload=offload, chunk_numel=chunk_numel, mem_available=lambda: 64 * GIB)


def _train(model: nn.Module, opt: torch.optim.Optimizer, steps: range) -> list[float]:
    """``steps`` steps of two micro-batches each, an LR schedule and gradient clipping at 0.5 through
    ``optimizer_tensors`` (as GRPOModule._optimizer_step); the norms before clipping."""
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for _ in range(steps.start):
        sched.step()
    norms = []
    for step in steps:
        g = torch.Generator().manual_seed(100 + step)
        for _ in range(2):
            x = torch.randn(8, 24, generator=g).to(torch.bfloat16)
            model(x).float().pow(2).mean().backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(optimizer_tensors(opt), 0.5)))
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
    return norms


def _same(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p.detach(), q.detach()), name


@pytest.mark.parametrize("offload", ["moments", "masters"])
def test_offload_follows_in_memory_masters_bitwise(offload):
    """Five steps with weight decay, an LR schedule and clipping: the same gradient norms, masters, bf16 weights and
    moments as `MasterWeightOptimizer`, bit for bit (torch's own AdamW function runs on each chunk)."""
    ref_model, off_model = _model(), _model()
    ref_opt, off_opt = _build(ref_model, "none"), _build(off_model, offload)
    assert off_opt.num_low_precision == ref_opt.num_low_precision == 3
    assert _train(ref_model, ref_opt, range(STEPS)) == _train(off_model, off_opt, range(STEPS))
    _same(ref_model, off_model)
    for m, o in zip(ref_opt.masters, off_opt.masters):
        assert torch.equal(m.detach(), o.detach())
    ref_sd, off_sd = ref_opt.state_dict(), off_opt.state_dict()
    assert ref_sd["inner"]["param_groups"] == off_sd["inner"]["param_groups"]  # the schedule's lr included
    for i, st in ref_sd["inner"]["state"].items():
        assert list(st) == list(off_sd["inner"]["state"][i])  # step, exp_avg, exp_avg_sq
        for k, v in st.items():
            assert torch.equal(v.cpu(), off_sd["inner"]["state"][i][k].cpu()), (i, k)
    assert not off_opt.state  # Lightning moves optimizer.state to the GPU on resume: the moments stay in host memory


@pytest.mark.parametrize(("first", "then"), [("none", "masters"), ("masters", "none"), ("moments", "masters")])
def test_a_checkpoint_resumes_with_offload_on_or_off(first, then):
    """Three steps under ``first``, its state_dict saved and loaded into a fresh model under ``then``, two more steps:
    the same as five uninterrupted steps in memory."""
    ref_model = _model()
    _train(ref_model, _build(ref_model, "none"), range(STEPS))
    a_model = _model()
    a_opt = _build(a_model, first)
    _train(a_model, a_opt, range(3))
    saved = a_opt.state_dict()
    saved = {"inner": saved["inner"], "masters": [m.clone() for m in saved["masters"]]}
    b_model = _model(seed=1)  # other weights: the masters come from the checkpoint, the model from the masters
    b_model.load_state_dict({k: v for k, v in a_model.state_dict().items() if "2." in k}, strict=False)  # fp32 LN
    b_opt = _build(b_model, then)
    b_opt.load_state_dict(saved)
    _train(b_model, b_opt, range(3, STEPS))
    _same(ref_model, b_model)


def test_host_memory_line_and_the_error_that_names_the_lower_setting(capsys):
    model = _model()
    need = host_bytes(model.parameters(), "masters")
    n_low = sum(p.numel() for p in model.parameters() if p.dtype == torch.bfloat16)
    assert need == {"masters": 4 * n_low, "moments": 8 * sum(p.numel() for p in model.parameters())}
    _build(model, "masters")
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("offload masters: pinning 0.0 GiB of host memory") and "64.0 GiB available" in line
    # the 7B: 8.29B parameters, masters + moments 92.6 GiB, on a host with 80 GiB available
    seven_b = {"masters": 4 * 8_290_000_000, "moments": 8 * 8_290_000_000}
    with pytest.raises(ValueError) as e:
        check_host_memory(seven_b, "masters", 80 * GIB)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("--model.optimisation.offload masters pins 92.6 GiB")
    assert "80.0 GiB available (MemAvailable" in msg and "--model.optimisation.offload moments" in msg
    assert "61.8 GiB" in msg  # what moments alone pin
    with pytest.raises(ValueError, match="but the host has 0.0 GiB available"):  # fails before pinning anything
        OffloadedAdamW(_model().parameters(), _adamw, offload="moments", mem_available=lambda: 1000)


def test_settings_are_checked_at_parse_time():
    assert OptimArgs().offload == "none"
    with pytest.raises(ValueError, match="--model.optimisation.offload must be one of"):
        OptimArgs(offload="cpu")
    with pytest.raises(ValueError, match="needs --model.optimisation.master_weights fp32"):
        OptimArgs(offload="moments", master_weights="none")
    with pytest.raises(ValueError, match="steps Adam / AdamW"):
        policy_optimizer(
            _model().parameters(),
            lambda p: torch.optim.SGD(p, lr=0.1),
            master_weights="fp32",
            offload="moments",
            distributed=False,
        )


def test_grpo_fit_with_masters_offloaded(tiny_model_dir, rec_dir, tmp_path):
    """``train.py fit`` of the tiny bf16 policy with ``offload: masters``: the module steps an `OffloadedAdamW`, the
    policy holds the rounding of its host masters, and a resume restores them from the checkpoint (which holds what
    `MasterWeightOptimizer` writes). A resume takes the module's settings from the checkpoint, offload included."""
    out = tmp_path / "run"
    flags = [
        "--model.init_args.policy.dtype",
        "bf16",
        "--trainer.precision",
        "bf16-true",
        "--trainer.max_steps",
        "2",
        "--trainer.limit_val_batches",
        "0",
        "--model.init_args.optimisation.offload",
        "masters",
    ]
    cli = cli_main(["fit", *_args(tiny_model_dir, rec_dir, out, *flags)])
    opt = cli.trainer.optimizers[0]
    assert isinstance(opt, OffloadedAdamW) and opt.offload == "masters" and opt.num_low_precision > 0
    lows = [p for p in cli.model.policy.parameters() if p.requires_grad]
    assert all(torch.equal(p.detach(), m.to(torch.bfloat16)) for p, m in zip(lows, opt.masters))
    path = sorted(out.rglob("*.ckpt"))[-1]
    ckpt = torch.load(path, weights_only=False)
    saved = ckpt["optimizer_states"][0]
    assert set(saved) == {"inner", "masters"} and len(saved["masters"]) == opt.num_low_precision
    assert all(set(st) == {"step", "exp_avg", "exp_avg_sq"} for st in saved["inner"]["state"].values())
    resumed = cli_main(["fit", *_args(tiny_model_dir, rec_dir, out, *flags), "--ckpt_path", str(path)])
    ropt = resumed.trainer.optimizers[0]
    assert isinstance(ropt, OffloadedAdamW) and resumed.trainer.global_step == 2
    for m, s in zip(ropt.masters, saved["masters"]):
        assert torch.equal(m, s)
