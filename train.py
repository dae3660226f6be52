"""Entry point: ``python train.py fit|validate|test --config configs/<name>.yaml [--flag value ...]``.

LightningCLI with ``parser_mode="omegaconf"`` (so configs may interpolate ``${...}``); the model and data classes are
chosen by ``class_path`` in the config (GRPOModule, SFTModule; RECDataModule, SyntheticDataModule).
"""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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
