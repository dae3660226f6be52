"""fp32 master weights: an AdamW update at the paper's lr (1e-6) moves a bf16 policy as it moves an fp32 one."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_grpo import _args  # the tiny GRPO run's flags (tests/ is on sys.path under pytest)
from torch import nn

from lightning_modules.models.precision import MasterWeightOptimizer, build_optimizer, fp32_default_dtype
from train import cli_main

REPO = Path(__file__).resolve().parents[2]
LR = 1e-6


def _adamw(params):
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.0)


def _weights(seed: int = 0) -> torch.Tensor:
    return torch.randn(256, 256, generator=torch.Generator().manual_seed(seed)) * 0.02  # a Linear weight's scale


def _grads(steps: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(256, 256, generator=g) * 1e-3 for _ in range(steps)]


def test_bf16_adamw_at_lr_1e6_loses_updates_masters_keep_them():
    """Ten AdamW steps of ~1e-6 each: a bf16 weight of std 0.02 has a spacing of ~6e-5 around its typical entry, so
    plain bf16 AdamW rounds most updates away; the fp32 masters follow the fp32 run (same gradients, rounded to bf16,
    and Adam's update is scale-free, so the difference is far below one update)."""
    w0, grads = _weights().to(torch.bfloat16).float(), _grads(10)  # representable in bf16: all three start equal
    ref = nn.Parameter(w0.clone())
    plain = nn.Parameter(w0.to(torch.bfloat16))
    mixed = nn.Parameter(w0.to(torch.bfloat16))
    opt_ref, opt_plain = _adamw([ref]), _adamw([plain])
    opt_mixed = MasterWeightOptimizer([mixed], _adamw)
    for g in grads:
        ref.grad, plain.grad, mixed.grad = g.clone(), g.to(torch.bfloat16), g.to(torch.bfloat16)
        for opt in (opt_ref, opt_plain, opt_mixed):
            opt.step()
            opt.zero_grad()
    moved_ref = (ref.detach() != w0).float().mean().item()
    moved_plain = (plain.detach() != w0.to(torch.bfloat16)).float().mean().item()
    master = opt_mixed.masters[0].detach()
    assert moved_ref > 0.999
    assert moved_plain < 0.3, f"bf16 AdamW moved {moved_plain:.1%} of the entries"  # ~12% here
    assert (master != w0).float().mean().item() > 0.999
    # 10 updates of ~1e-6 each: the masters agree with fp32 to a small fraction of one update
    assert (master - ref.detach()).abs().max().item() < 0.05 * LR
    assert master.dtype == torch.float32 and mixed.dtype == torch.bfloat16
    assert torch.equal(mixed.detach(), master.to(torch.bfloat16))  # the model holds the rounded masters


def test_gradients_accumulate_in_fp32_across_micro_batches():
    """Two micro-batches: the bf16 gradient of each is moved into the master's fp32 gradient as soon as autograd
    accumulates it, so the sum is taken in fp32 and the bf16 ``.grad`` is freed."""
    torch.manual_seed(0)
    lin = nn.Linear(64, 64, bias=False).to(torch.bfloat16)
    opt = MasterWeightOptimizer(lin.parameters(), _adamw)
    xs = [torch.randn(8, 64, dtype=torch.bfloat16) for _ in range(2)]
    expected = torch.zeros(64, 64)
    for x in xs:
        lin(x).float().sum().backward()
        expected += x.float().sum(0)[None, :].expand(64, 64)  # d/dW sum(W x) = x summed over the batch, per row
    assert lin.weight.grad is None
    master_grad = opt.masters[0].grad
    assert master_grad.dtype == torch.float32
    torch.testing.assert_close(master_grad, expected, rtol=1e-2, atol=1e-2)  # each micro-batch's grad is bf16


def test_state_dict_round_trip_restores_masters_and_refreshes_the_model():
    w0 = _weights()
    p = nn.Parameter(w0.to(torch.bfloat16))
    opt = MasterWeightOptimizer([p], _adamw)
    for g in _grads(3):
        p.grad = g.to(torch.bfloat16)
        opt.step()
        opt.zero_grad()
    state = opt.state_dict()
    fresh = nn.Parameter(w0.to(torch.bfloat16))
    opt2 = MasterWeightOptimizer([fresh], _adamw)
    opt2.load_state_dict(state)
    assert torch.equal(opt2.masters[0], opt.masters[0])
    assert torch.equal(fresh.detach(), p.detach())
    assert opt2.state[opt2.masters[0]]["step"] == 3


def test_fp32_parameters_need_no_masters_and_mismatch_is_a_clear_error():
    lin = nn.Linear(4, 4)
    assert isinstance(
        build_optimizer(lin.parameters(), _adamw, master_weights="fp32", distributed=False),
        type(_adamw([nn.Parameter(torch.zeros(1))])),
    )
    bf = nn.Linear(4, 4).to(torch.bfloat16)
    opt = build_optimizer(bf.parameters(), _adamw, master_weights="fp32", distributed=True)
    assert isinstance(opt, MasterWeightOptimizer) and opt.num_low_precision == 2 and not opt._hooks
    with pytest.raises(ValueError, match="master_weights"):
        build_optimizer(bf.parameters(), _adamw, master_weights="fp16", distributed=False)
    other = MasterWeightOptimizer(nn.Linear(4, 4, bias=False).to(torch.bfloat16).parameters(), _adamw)
    with pytest.raises(ValueError, match="same --model.policy.dtype"):
        other.load_state_dict(opt.state_dict())


def test_fp32_default_dtype_undoes_bf16_true():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with fp32_default_dtype():
            assert torch.tensor([637.3]).dtype == torch.float32
        assert torch.get_default_dtype() == torch.bfloat16
    finally:
        torch.set_default_dtype(old)


def test_grpo_fit_bf16_true_fast_engines_moves_the_policy_at_lr_1e6(tiny_model_dir, rec_dir, tmp_path):
    """The paper's numerics through ``train.py``: ``bf16-true`` + ``dtype: bf16`` with the fast rollout engine and the
    packed update engine, lr 1e-6. Two steps change the fp32 masters of every weight that got a gradient, the policy
    holds their bf16 rounding, and the checkpoint carries the masters."""
    out = tmp_path / "run"
    args = [
        "fit",
        *_args(
            tiny_model_dir,
            rec_dir,
            out,
            "--model.init_args.policy.dtype",
            "bf16",
            "--trainer.precision",
            "bf16-true",
            "--model.init_args.engines.rollout_engine",
            "fast",
            "--model.init_args.engines.update_engine",
            "packed",
            "--model.init_args.optimizer.init_args.lr",
            str(LR),
            "--trainer.max_steps",
            "2",
            "--trainer.limit_val_batches",
            "0",
        ),
    ]
    cli = cli_main(args)
    model = cli.model
    opt = cli.trainer.optimizers[0]
    assert isinstance(opt, MasterWeightOptimizer) and opt.num_low_precision > 0
    assert all(p.dtype == torch.bfloat16 for p in model.policy.parameters())
    assert model.reference is not None and next(model.reference.parameters()).dtype == torch.bfloat16
    got_grad = moved = 0
    ref = dict(model.reference.named_parameters())  # the reference = the initial weights
    for (name, p), m in zip(((n, q) for n, q in model.policy.named_parameters() if q.requires_grad), opt.masters):
        assert torch.equal(p.detach(), m.detach().to(torch.bfloat16)), name
        if m in opt.state:
            g = opt.state[m]["exp_avg_sq"] > 0  # entries that received a gradient
            got_grad += int(g.sum())
            moved += int((m.detach() != ref[name].detach().float())[g].sum())
    # lr 1e-6 moves the masters (97% here; the rest had gradients far below AdamW's eps, which fp32 barely moves too;
    # bf16 AdamW without masters moves ~12%, see the first test)
    assert got_grad > 0 and moved / got_grad > 0.95, (moved, got_grad)
    path = sorted(out.rglob("*.ckpt"))[-1]
    ckpt = torch.load(path, weights_only=False)
    saved = ckpt["optimizer_states"][0]["masters"]
    assert len(saved) == opt.num_low_precision
    # resuming restores the fp32 masters (not a re-rounding of the bf16 weights) and the policy is their rounding
    resumed = cli_main([*args, "--ckpt_path", str(path)])
    ropt = resumed.trainer.optimizers[0]
    assert resumed.trainer.global_step == 2
    for (_, m), s in zip(ropt._low, saved):
        assert torch.equal(m.detach(), s)
    lows = [p for p, _ in ropt._low]
    assert all(torch.equal(p.detach(), s.to(torch.bfloat16)) for p, s in zip(lows, saved))
