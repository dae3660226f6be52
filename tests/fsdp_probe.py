"""One GRPO optimizer step at a fixed global batch with fixed (teacher-forced) completions, on N processes (CPU: gloo).

``python tests/fsdp_probe.py --model DIR --data DIR --devices N --strategy {auto,ddp,fsdp2} --out FILE`` writes the
full policy weights after the step (rank 0, fp32) and the step's wall time: tests/cli/test_fsdp.py compares 1 process
with 2 under DDP and FSDP2. Lightning launches the other ranks by running this file again.

Why teacher forcing: sampling draws from each rank's own RNG stream, so 1 and N processes would train on different
completions. `TeacherForcedEngine` is a real rollout engine (the shared ``RolloutEngine.generate`` builds the rollout)
whose "sampling" writes a fixed answer per (prompt, row): boxes that differ per row, so the group's rewards and
advantages are not zero; some rows end with EOS and others run to the length limit, so the ranks hold different token
counts and the global batch's token-mean must be the same whatever the number of processes.
"""

from __future__ import annotations

import argparse
import json
import time
import zlib
from pathlib import Path

import lightning as L
import torch

from datamodules.synthetic import SyntheticDataModule
from lightning_modules.engines.base import RolloutEngine
from lightning_modules.grpo import GRPOModule
from lightning_modules.models.fsdp import full_state_dict


class TeacherForcedEngine(RolloutEngine):
    """Completion ``j`` of a prompt is ``<answer>[x1, y1, x2, y2]</answer>`` with a box drawn from ``crc32(prompt, j)``,
    then for two rows in three ``x mod 7`` space tokens and EOS; cut or padded (with space tokens) to ``length``."""

    length = 40

    def sample(self, model, processor, prompts, images, *, group_size, sampling, suppress_ids, eos_ids):
        tok = processor.tokenizer
        enc = processor(
            text=[t for t in prompts for _ in range(group_size)],
            images=[im for im in images for _ in range(group_size)],
            return_tensors="pt",
            padding=True,
        )
        pad = tok.convert_tokens_to_ids(tok.tokenize(" "))[0]
        eos = eos_ids[0]
        rows = []
        for p in prompts:
            for j in range(group_size):
                g = torch.Generator().manual_seed(zlib.crc32(f"{p}|{j}".encode()))
                x, y = torch.randint(0, 60, (2,), generator=g).tolist()
                ids = tok(f"<answer>[{x}, {y}, {x + 40}, {y + 30}]</answer>", add_special_tokens=False)["input_ids"]
                stop = [pad] * (x % 7) + [eos] if (x + j) % 3 else []  # a third run to the length limit
                rows.append((ids + stop + [pad] * self.length)[: self.length])
        return torch.tensor(rows), enc


class StepClock(L.Callback):
    """Wall time of each training batch, and the full policy weights after fit (gathered from the shards)."""

    def __init__(self, out: Path):
        self.out, self.times, self._t = out, [], 0.0

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self._t = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.times.append(time.perf_counter() - self._t)

    def on_train_end(self, trainer, pl_module):
        state = full_state_dict(pl_module.policy)  # every rank: a collective under FSDP2
        if trainer.is_global_zero:
            torch.save({k: v.float().clone() for k, v in state.items()}, self.out)
            self.out.with_suffix(".json").write_text(
                json.dumps({"step_s": self.times, "world_size": trainer.world_size, "global_step": trainer.global_step})
            )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--accelerator", default="cpu", help="gpu: the same check on GPUs (NCCL)")
    ap.add_argument("--global_batch", type=int, default=4)
    ap.add_argument("--steps", type=int, default=1)
    ap.add_argument("--gradient_checkpointing", action="store_true")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.manual_seed(0)
    module = GRPOModule(
        policy={
            "model_name_or_path": args.model,
            "dtype": "fp32",
            "gradient_checkpointing": args.gradient_checkpointing,
        },
        sampling={"prompt_template": "toy", "group_size": 3, "max_new_tokens": TeacherForcedEngine.length},
        method={"class_path": "grpo", "init_args": {"format": "think_answer"}},
        # 4 prompts x 3 rows on one process: 3 micro-batches; on two: 2 per rank (accumulation)
        engines={"micro_batch_size": 4},
        kl={"coef": 0.04},
        optimizer=lambda params: torch.optim.SGD(params, lr=0.5),  # the update is the clipped gradient itself
    )
    module.rollout_engine = TeacherForcedEngine()
    data = SyntheticDataModule(
        data_root=args.data,
        train_files=["train.jsonl"],
        batch_size=args.global_batch // args.devices,
        max_train_samples=args.global_batch * args.steps,
    )
    trainer = L.Trainer(
        accelerator=args.accelerator,
        devices=args.devices,
        strategy=args.strategy,
        precision="32-true",
        max_steps=args.steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        callbacks=[StepClock(Path(args.out))],
    )
    trainer.fit(module, datamodule=data)


if __name__ == "__main__":
    main()
