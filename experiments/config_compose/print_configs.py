"""Every training config under ``configs/``, and the stacks of ``--config`` files that the tests and the Makefile use,
as ``python train.py fit --config ... --print_config`` prints them: one file each, to compare two checkouts.

    python experiments/config_compose/print_configs.py REPO OUT     # REPO: a checkout (its train.py runs), OUT: a folder
    python experiments/config_compose/print_configs.py --compare OUT_A OUT_B

Run in one process (``cli_main`` per stack), from ``REPO``; the result of the run for the configs that compose is in
experiments/config_compose.md.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from pathlib import Path


def stacks(configs: Path) -> list[tuple[str, ...]]:
    """The stacks, as paths relative to the checkout: each base alone, then the overlay stacks."""
    rel = lambda p: p.relative_to(configs.parent).as_posix()  # noqa: E731
    bases = sorted(p for p in configs.glob("*.yaml") if "_stage" not in p.stem)
    out = [(rel(b),) for b in bases]
    out += [("configs/toy_sft.yaml", rel(s)) for s in sorted(configs.glob("toy_sft_stage*.yaml"))]
    baselines = sorted((configs / "baselines").glob("*.yaml"))
    for base in ("tiny", "rec_3b", "rec_7b", "rec_3b_1gpu"):
        out += [(f"configs/{base}.yaml", rel(o)) for o in baselines]
    for base in ("evolved_tiny", "evolved_3b"):
        out += [(f"configs/{base}.yaml", rel(o)) for o in sorted((configs / "overlays").glob("evolved_*.yaml"))]
    out += [("configs/cycle_tiny.yaml", rel(o)) for o in sorted((configs / "overlays").glob("cycle_tiny_*.yaml"))]
    out += [
        ("configs/cycle_tiny.yaml", "configs/overlays/cycle_judge.yaml"),
        ("configs/cycle_4b.yaml", "configs/overlays/hf_engines.yaml"),
        ("configs/cycle_4b_temporal.yaml", "configs/overlays/hf_engines.yaml"),
        ("configs/cycle_4b.yaml", "configs/overlays/cycle_4b_parquet.yaml", "configs/overlays/hf_engines.yaml"),
        ("configs/tiny.yaml", "configs/overlays/heldout_summary.yaml"),
    ]
    out += [(rel(b), "configs/overlays/vllm.yaml") for b in bases]
    return out


def print_all(repo: Path, out: Path) -> None:
    os.chdir(repo)
    sys.path.insert(0, str(repo))
    sys.argv[1:] = []  # cli_main gets its own args (LightningCLI warns when it sees both)
    from train import cli_main

    out.mkdir(parents=True, exist_ok=True)
    for stack in stacks(repo / "configs"):
        name = "+".join(Path(p).relative_to("configs").with_suffix("").as_posix().replace("/", "~") for p in stack)
        buf, err = io.StringIO(), io.StringIO()
        code: object = 0
        with contextlib.redirect_stdout(buf), contextlib.redirect_stderr(err):
            try:
                cli_main(["fit", *[a for p in stack for a in ("--config", p)], "--print_config"])
            except SystemExit as e:
                code = e.code
        text = buf.getvalue() if code in (None, 0) else f"exit {code}\n{err.getvalue()}"
        (out / f"{name}.yaml").write_text(text, encoding="utf-8")


def compare(a: Path, b: Path) -> int:
    names = sorted({p.name for p in a.glob("*.yaml")} | {p.name for p in b.glob("*.yaml")})
    differ = [
        n for n in names if not (a / n).is_file() or not (b / n).is_file() or (a / n).read_text() != (b / n).read_text()
    ]
    errors = [n for n in names if (a / n).is_file() and (a / n).read_text().startswith("exit ")]
    print(f"{len(names)} stacks, {len(names) - len(differ)} printed equal, {len(differ)} differ: {differ}")
    print(f"{len(errors)} of them exit with an error in both (the same message): {errors}")
    return 1 if differ else 0


if __name__ == "__main__":
    if sys.argv[1] == "--compare":
        raise SystemExit(compare(Path(sys.argv[2]), Path(sys.argv[3])))
    print_all(Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve())
