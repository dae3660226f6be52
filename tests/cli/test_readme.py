"""The README's commands, read from the README itself, run as written (the GPU lines on the CPU with the toy model and
toy data swapped in, as tests/cli/test_config_runs.py swaps them; the notebook through the README's nbconvert line)."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_config_runs import compose, cpu_swap, toy_data  # noqa: F401 - toy_data is a fixture

from train import cli_main

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


def readme_commands() -> list[str]:
    """Every command line of the README's ```bash blocks, without its trailing comment."""
    text = README.read_text(encoding="utf-8")
    out = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split("  #", 1)[0].strip()
            if line:
                out.append(line)
    return out


def _commands(prefix: str) -> list[list[str]]:
    return [shlex.split(c) for c in readme_commands() if c.startswith(prefix)]


def test_the_readme_is_short_and_its_commands_are_known():
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 100
    kinds = ("make ", "python train.py ", "python -m sweep ", "wandb sweep ", "RUNS=", "python -m synth.server ")
    for c in readme_commands():
        assert c.startswith(kinds), f"a README command no test runs: {c}"
    assert [c[1] for c in _commands("make ")] == ["train", "test"]


def test_the_two_make_commands_do_what_the_readme_says():
    makefile = (REPO / "Makefile").read_text()
    assert re.search(r"^export OMP_NUM_THREADS", makefile, flags=re.M), "make train must cap torch's threads"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    train = subprocess.run(["make", "-n", "train"], cwd=REPO, capture_output=True, text=True, env=env)
    assert "train.py fit --config configs/tiny.yaml" in train.stdout  # tiny.yaml's fit runs in test_config_runs
    test = subprocess.run(["make", "-n", "test"], cwd=REPO, capture_output=True, text=True, env=env)
    assert "-m pytest" in test.stdout


@pytest.fixture(scope="module")
def gpu_lines(toy_data, tmp_path_factory) -> dict:  # noqa: F811 - the imported fixture
    """The README's ``train.py`` lines in order, each composed as written, swapped for the CPU and run (fits of 1 step,
    one eval batch); a line's ``--ckpt_path`` into outputs/ is the checkpoint an earlier line of the README wrote."""
    root = tmp_path_factory.mktemp("readme")
    written: dict[str, Path] = {}
    done = {}
    for i, argv in enumerate(_commands("python train.py ")):
        sub, rest = argv[2], argv[3:]
        configs = [REPO / rest[k + 1] for k, a in enumerate(rest) if a == "--config"]
        flags, k = [], 0
        while k < len(rest):
            if rest[k] == "--config":
                k += 2
                continue
            flags.append(rest[k])
            k += 1
        cfg = cpu_swap(compose(tuple(configs)), toy_data, root / f"line{i}")
        resume = sub == "fit" and "--ckpt_path" in flags
        cfg["trainer"].update(max_epochs=2 if resume else 1, max_steps=2 if resume else 1, limit_val_batches=1)
        cfg["data"]["init_args"]["max_train_samples"] = 2
        path = root / f"line{i}.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        if "--ckpt_path" in flags:
            j = flags.index("--ckpt_path")
            flags[j + 1] = str(written[flags[j + 1]])
        cli = cli_main([sub, "--config", str(path), *flags])
        out = Path(cfg["trainer"]["default_root_dir"])
        name = out.name
        run = configs[0].stem
        if sub == "fit":
            written.setdefault(f"outputs/{run}/checkpoints/last.ckpt", out / "checkpoints/last.ckpt")
        done[" ".join(argv)] = (cli, out, name)
    return done


def test_every_train_line_of_the_readme_runs(gpu_lines):
    lines = _commands("python train.py ")
    assert len(gpu_lines) == len(lines) >= 4
    for argv in lines:
        cli, out, _ = gpu_lines[" ".join(argv)]
        if argv[2] == "fit":
            assert cli.trainer.global_step >= 1 and (out / "checkpoints/last.ckpt").exists(), argv
        else:
            assert any(k.startswith("test/") for k in cli.trainer.callback_metrics), argv


def test_the_sweep_lines_of_the_readme(capsys):
    from sweep.__main__ import main as sweep_main

    (argv,) = _commands("python -m sweep ")
    assert sweep_main([*argv[3:], "--dry-run"]) == 0
    points = capsys.readouterr().out.splitlines()
    assert len(points) == 2 and all("train.py fit --config configs/tiny.yaml" in p for p in points)
    (online,) = _commands("wandb sweep ")
    sweep = yaml.safe_load((REPO / online[2]).read_text())
    assert sweep["program"] == "train.py" and shutil.which("wandb", path=str(Path(sys.executable).parent))


def test_the_notebook_line_of_the_readme_executes(gpu_lines, tmp_path):
    (argv,) = _commands("RUNS=")
    runs = [str(out) for _, out, _ in gpu_lines.values() if (out / "metrics.jsonl").is_file()]
    assert runs, "no README fit wrote metrics.jsonl"
    jupyter = Path(sys.executable).parent / argv[1]
    cmd = [str(jupyter), *argv[2:]]
    cmd[cmd.index("--output-dir") + 1] = str(tmp_path)
    env = {**os.environ, "RUNS": ",".join(runs), "OUT": str(tmp_path / "figures"), "WANDB_MODE": "offline"}
    env.pop("WANDB_API_KEY", None)
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "collapse_curves.ipynb").is_file() and list((tmp_path / "figures").glob("*.png"))


def test_the_data_server_line_of_the_readme_names_a_valid_config():
    from synth.config import load_config

    (argv,) = _commands("python -m synth.server ")
    cfg = load_config(REPO / argv[argv.index("--config") + 1])
    assert cfg.painter.name == "diffusers" and cfg.foreground.name
