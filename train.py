"""Entry point: ``python train.py fit|validate|test|predict|export --config configs/<name>.yaml [--flag value ...]``.

The command line lives in ``cli.main`` (LightningCLI with run folders, named callbacks, ``export`` and one-line
errors; docs/outputs.md); the model and data classes are chosen by ``class_path`` (or a short class name) in the config.
"""

from __future__ import annotations

from cli.main import cli_main, main

__all__ = ["cli_main", "main"]

if __name__ == "__main__":
    main()
