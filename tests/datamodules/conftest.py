"""tests/datamodules/ mirrors the package datamodules/ and has no __init__.py (one would make this folder the package
`datamodules` and shadow the real one). A plain `pytest` run (not `python -m pytest`) puts tests/ but not the
repository on sys.path, so `import datamodules` would find this folder as a namespace package: put the repository
first so that the real package wins."""

import sys
from pathlib import Path

_ROOT = str(Path(__file__).resolve().parents[2])
if sys.path[:1] != [_ROOT]:
    sys.path.insert(0, _ROOT)
