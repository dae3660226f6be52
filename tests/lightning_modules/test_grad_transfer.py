"""bench/grad_transfer.py: the signal fraction recovers a known shared direction, and the capture runs through
``train.py fit`` (one gradient of every trainable parameter per optimizer step)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("grad_transfer", REPO / "bench/grad_transfer.py")
gt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gt)


def test_signal_fraction_recovers_the_shared_share():
    gen = torch.Generator().manual_seed(0)
    d, n = 4000, 200
    shared = torch.randn(d, generator=gen)
    shared = shared / shared.norm() * 0.5  # |s|^2 = 0.25 against a noise of E|e|^2 = 1: f = 0.2
    gs = [shared + torch.randn(d, generator=gen) / d**0.5 for _ in range(n)]
    r = gt.signal_fraction(gs, reps=200)
    assert abs(r["estimate"] - 0.2) < 0.03 and r["lo"] < 0.2 < r["hi"]
    unrelated = gt.signal_fraction([torch.randn(d, generator=gen) for _ in range(n)], reps=200)
    assert abs(unrelated["estimate"]) < 0.01 and unrelated["lo"] < 0 < unrelated["hi"]
    assert abs(gt.alignment([torch.randn(d, generator=gen) for _ in range(64)]) - 1 / 8) < 0.03


def test_cosines_and_pairs():
    gen = torch.Generator().manual_seed(1)
    a = [torch.randn(50, generator=gen) for _ in range(4)]
    m = gt.cosines(a, a)
    want = torch.nn.functional.cosine_similarity(a[1], a[3], dim=0)
    assert torch.isclose(m[1, 3].float(), want, atol=1e-6) and torch.allclose(
        m.diagonal(), torch.ones(4, dtype=m.dtype)
    )
    assert gt.off_diagonal(m).tolist() == [m[i, j].item() for i in range(4) for j in range(i + 1, 4)]


def test_capture_keeps_one_gradient_a_step(tmp_path):
    flags = [
        f"--model.init_args.policy.model_name_or_path={REPO / 'checkpoints/toy-qwen2.5-vl'}",
        '--data.init_args.toy.splits={"train": 2, "val": 4, "ood": 4}',
        "--trainer.max_epochs=2",
        "--model.init_args.sampling.group_size=4",
        "--model.init_args.sampling.max_new_tokens=48",
        "--name=grad_transfer_test",
    ]
    grads = gt.capture(["configs/tiny.yaml", "configs/baselines/grpo.yaml"], flags, tmp_path)
    assert len(grads) == 4  # 2 scenes x 2 epochs, batch 1
    n = grads[0].numel()
    assert all(g.numel() == n for g in grads) and n > 1_000_000  # every trainable parameter of the toy policy
    assert all(torch.isfinite(g).all() for g in grads)
