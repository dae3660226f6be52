"""lightning_modules' own layers (lightning_modules/__init__.py): models < engines < evaluation < methods < sft_examples <
sft_eval < grpo / sft, with the leaf modules (checkpoints, judge) importable from any of them. A
module imports its own sub-package and the ones below it, never one above: read from the source, lazy imports
included."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_modules"
ORDER = {"models": 1, "engines": 2, "evaluation": 3, "methods": 4, "grpo": 5, "sft": 5}
ORDER |= {"sft_examples": 4.4, "sft_eval": 4.6}  # SFTModule's parts: its (prompt, target) pairs, then its validation
LEAVES = {"checkpoints", "judge"}


def _part(module: str) -> str:
    """The sub-package (or top-level module) of ``lightning_modules.<part>...``."""
    return module.split(".")[1]


def test_each_sub_package_imports_only_the_ones_below_it():
    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).with_suffix("")
        src = rel.parts[1] if len(rel.parts) > 1 and rel.parts[1] != "__init__" else None
        if src is None or src in LEAVES:
            assert src is None or not _lm_imports(path), f"{rel} is a leaf and imports lightning_modules"
            continue
        for dst in {_part(m) for m in _lm_imports(path)} - {src}:
            if dst not in LEAVES and ORDER.get(dst, 99) >= ORDER[src]:
                bad.append(f"{rel} -> lightning_modules.{dst}")
    assert not bad, "imports that go up (or sideways) inside lightning_modules:\n" + "\n".join(bad)


def _lm_imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names if a.name.startswith("lightning_modules.")}
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_modules"):
            if node.module == "lightning_modules":  # from lightning_modules import rewards, models, ...
                out |= {f"lightning_modules.{a.name}" for a in node.names}
            else:
                out.add(node.module)
    return out
