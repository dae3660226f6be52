"""Entry point: ``python train.py fit|validate|test --config configs/<name>.yaml [--flag value ...]``.

LightningCLI with ``parser_mode="omegaconf"`` (so configs may interpolate ``${...}``); the model and data classes are
chosen by ``class_path`` in the config (GRPOModule, SFTModule; RECDataModule, SyntheticDataModule).
"""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# GRPO's shapes change every step (prompt and completion lengths); expandable segments keep the caching allocator from
# fragmenting near the memory limit (the 3B one-GPU config peaks at ~113 GiB). Set before CUDA initialises.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

# GRPOModule steps its optimizer inside training_step (several updates per rollout), so a checkpoint holding the
# post-step state is exactly what a resume needs; Lightning's advice to save the pre-step state does not apply.
warnings.filterwarnings("ignore", message=".*ModelCheckpoint with manual optimization.*")
warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")

from lightning.pytorch.cli import LightningCLI  # noqa: E402


def cli_main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    import lightning as L

    return LightningCLI(
        L.LightningModule,
        L.LightningDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        parser_kwargs={"parser_mode": "omegaconf"},
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


if __name__ == "__main__":
    cli_main()
