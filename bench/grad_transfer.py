"""Component diagnostic (issue 40, not a training figure): do the GRPO gradients of different toy scenes point the same
way, and does one scene's gradient agree with itself under a second rollout?

    OMP_NUM_THREADS=1 python bench/grad_transfer.py [--ckpt checkpoints/toy-qwen2.5-vl] [--scenes 48] [--out r.json]

``train.py fit`` builds the run as the RL probes do (configs/tiny.yaml + configs/baselines/grpo.yaml: VLM-R1 prompt,
G 12, T 0.7) with one scene a step, the learning rate at 0 so the policy never moves, no shuffling, and two epochs: every
scene is rolled out twice from the same weights. A callback keeps each step's gradient (after the module's own loss,
advantages and clipping: the direction an optimizer step would take). A second run takes the SFT gradient of each
scene (configs/baselines/sft.yaml with the toy's own target and prompt: the exact answer). Printed:

- within-scene cosine: the two rollouts' GRPO gradients of one scene (sampling noise against a scene's own signal);
- cross-scene cosine: GRPO gradients of different scenes (what a step on one scene does for another);
- SFT cross-scene cosine, and GRPO vs SFT on the same scene (does RL's step point at the exact answer's?);
- alignment ||sum g|| / sum ||g|| over one gradient per scene: 1 if all agree, about 1/sqrt(n) if unrelated;
- signal fraction |E g|^2 / E|g|^2 (unbiased, 95% bootstrap interval over scenes): how much of one scene's gradient is
  the direction every scene shares, i.e. what a step on one scene does for the expected reward (or loss) of all.

A group whose G answers all score the same has no advantage and no gradient; such scenes are counted and left out.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
from lightning.pytorch.callbacks import Callback

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from train import cli_main  # noqa: E402


class GradCapture(Callback):
    """Keeps the flattened gradient of every trainable policy parameter at each optimizer step (fp32, on the CPU)."""

    def __init__(self) -> None:
        self.grads: list[torch.Tensor] = []

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        params = [p for p in pl_module.policy.parameters() if p.requires_grad]
        flat = [
            p.grad.detach().float().flatten() if p.grad is not None else p.new_zeros(p.numel()).float() for p in params
        ]
        self.grads.append(torch.cat(flat).cpu().clone())


def capture(configs: list[str], flags: list[str], work: Path) -> list[torch.Tensor]:
    args = [a for c in configs for a in ("--config", str(REPO / c))]
    common = [
        f"--data.init_args.data_root={work / 'data'}",
        "--data.init_args.batch_size=1",
        "--data.init_args.shuffle=false",
        "--trainer.limit_val_batches=0",
        "--trainer.num_sanity_val_steps=0",
        "--trainer.logger=false",
        "--trainer.enable_progress_bar=false",
        "--trainer.enable_checkpointing=false",
        f"--trainer.default_root_dir={work / 'run'}",
        "--callbacks.checkpoint=null",
        "--callbacks.gallery=null",
        "--callbacks.completions=null",
        "--callbacks.synthesis=null",
        "--model.init_args.optimizer.init_args.lr=0.0",
    ]
    cli = cli_main([*args, *common, *flags], run=False)
    cap = GradCapture()
    cli.trainer.callbacks.append(cap)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    return cap.grads


def cosines(a: list[torch.Tensor], b: list[torch.Tensor]) -> torch.Tensor:
    """The matrix of cosines between the gradients of ``a`` (rows) and of ``b`` (columns)."""
    unit = [torch.nn.functional.normalize(torch.stack(x).double(), dim=1) for x in (a, b)]
    return unit[0] @ unit[1].T


def stats(xs: torch.Tensor) -> dict[str, float]:
    if xs.numel() == 0:
        return {"n": 0}
    return {
        "n": xs.numel(),
        "mean": float(xs.mean()),
        "sd": float(xs.std()) if xs.numel() > 1 else 0.0,
        "min": float(xs.min()),
        "max": float(xs.max()),
    }


def off_diagonal(m: torch.Tensor) -> torch.Tensor:
    """The entries above the diagonal of a square matrix (each pair of different scenes once)."""
    return m[torch.triu_indices(*m.shape, offset=1).unbind()]


def alignment(gs: list[torch.Tensor]) -> float:
    return float(torch.stack(gs).sum(0).norm() / sum(g.norm() for g in gs)) if gs else float("nan")


def signal_fraction(gs: list[torch.Tensor], reps: int = 2000, seed: int = 0) -> dict[str, float]:
    """|E g|^2 / E|g|^2 over scenes, unbiased (the mean dot product of different scenes' gradients over the mean
    squared norm), with a 95% bootstrap interval over scenes: the share of a scene's gradient that all scenes share."""
    k = torch.stack(gs).double()
    k = k @ k.T
    n = k.shape[0]

    def frac(idx: torch.Tensor) -> float:
        sub = k[idx][:, idx]
        same = idx[:, None] == idx[None, :]
        return float(sub[~same].mean() / sub.diagonal().mean())

    gen = torch.Generator().manual_seed(seed)
    boot = sorted(frac(torch.randint(0, n, (n,), generator=gen)) for _ in range(reps))
    return {"estimate": frac(torch.arange(n)), "lo": boot[int(0.025 * reps)], "hi": boot[int(0.975 * reps) - 1]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", default="checkpoints/toy-qwen2.5-vl")
    ap.add_argument("--scenes", type=int, default=48)
    ap.add_argument("--group-size", type=int, default=12)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--out", default=None, help="JSON file for the figures")
    a = ap.parse_args()
    sys.argv = sys.argv[:1]  # the runs' flags go to cli_main as args, not through the command line
    t0 = time.time()
    model = f"--model.init_args.policy.model_name_or_path={a.ckpt}"
    splits = f'--data.init_args.toy.splits={{"train": {a.scenes}, "val": 4, "ood": 4}}'
    with tempfile.TemporaryDirectory() as tmp:
        rl = capture(
            ["configs/tiny.yaml", "configs/baselines/grpo.yaml"],
            [
                model,
                splits,
                "--trainer.max_epochs=2",
                f"--model.init_args.sampling.group_size={a.group_size}",
                f"--model.init_args.sampling.temperature={a.temperature}",
                "--name=grad_transfer_grpo",
            ],
            Path(tmp) / "grpo",
        )
        sft = capture(
            ["configs/tiny.yaml", "configs/baselines/sft.yaml"],
            [
                model,
                splits,
                "--trainer.max_epochs=1",
                "--model.init_args.target=toy_grounded",
                "--model.init_args.prompt_template=toy",
                "--name=grad_transfer_sft",
            ],
            Path(tmp) / "sft",
        )
    n = a.scenes
    if len(rl) != 2 * n or len(sft) != n:
        raise SystemExit(
            f"expected {2 * n} GRPO and {n} SFT steps (one scene a step), got {len(rl)} and {len(sft)}: a fit stopped "
            "early or skipped steps; its log is above"
        )
    first, second = rl[:n], rl[n:]
    live = [[bool(g.norm() > 0) for g in first], [bool(g.norm() > 0) for g in second]]
    both = [i for i in range(n) if live[0][i] and live[1][i]]
    idx = [i for i in range(n) if live[0][i] or live[1][i]]  # a scene with a gradient in at least one rollout
    rl_one = [first[i] if live[0][i] else second[i] for i in idx]
    within = cosines([first[i] for i in both], [second[i] for i in both]).diagonal()
    rl_sft = cosines(rl_one, [sft[i] for i in idx])
    other = ~torch.eye(len(idx), dtype=torch.bool)
    res = {
        "what": "cosines between per-scene gradients at fixed weights (bench/grad_transfer.py; a component diagnostic)",
        "checkpoint": a.ckpt,
        "scenes": n,
        "group_size": a.group_size,
        "temperature": a.temperature,
        "zero_gradient_rollouts": sum(not x for row in live for x in row),
        "grpo_within_scene": stats(within),
        "grpo_cross_scene": stats(off_diagonal(cosines(rl_one, rl_one))),
        "sft_cross_scene": stats(off_diagonal(cosines(sft, sft))),
        "grpo_vs_sft_same_scene": stats(rl_sft.diagonal()),
        "grpo_vs_sft_other_scene": stats(rl_sft[other]),
        "alignment": {
            "grpo": alignment(rl_one),
            "sft": alignment(sft),
            "unrelated_reference": 1 / math.sqrt(len(idx) or 1),
        },
        "signal_fraction": {"grpo": signal_fraction(rl_one), "sft": signal_fraction(sft)},
        "seconds": round(time.time() - t0, 1),
    }
    for k in (
        "grpo_within_scene",
        "grpo_cross_scene",
        "sft_cross_scene",
        "grpo_vs_sft_same_scene",
        "grpo_vs_sft_other_scene",
    ):
        s = res[k]
        print(f"{k:<26} n {s['n']:>5}  mean {s.get('mean', float('nan')):+.4f}  sd {s.get('sd', float('nan')):.4f}")
    print(
        "alignment ||sum g|| / sum ||g||:",
        {k: round(v, 4) for k, v in res["alignment"].items()},
        f"zero-gradient rollouts {res['zero_gradient_rollouts']} of {2 * n}  ({res['seconds']} s)",
    )
    for k, v in res["signal_fraction"].items():
        print(f"signal fraction |E g|^2 / E|g|^2, {k}: {v['estimate']:+.4f} [{v['lo']:+.4f}, {v['hi']:+.4f}]")
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
