"""Every command line the W&B sweeps in configs/sweeps/ and experiments/sweeps/ (the toy tuning search) would run is
accepted by the CLI and carries its value.

The grid is expanded here (W&B expands it server-side); the command is rendered with W&B's own macro code
(``wandb.sdk.launch.sweeps.utils``, what ``wandb agent`` calls) when it is importable, else with the same rules:
``${env}`` -> ``/usr/bin/env``, ``${interpreter}`` -> ``python``, ``${program}`` -> the program,
``${args}`` -> ``--<name>=<value>`` per parameter.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from runner import analysis, figures
from runner.points import Point, run_points
from runner.sweep import main as sweep_main
from runner.sweep import plan
from train import cli_main

REPO = Path(__file__).resolve().parents[2]
SWEEPS = sorted((REPO / "configs/sweeps").glob("*.yaml")) + sorted((REPO / "experiments/sweeps").glob("*.yaml"))


def _args_macros(params: dict) -> dict[str, list[str]]:
    try:
        from wandb.sdk.launch.sweeps.utils import create_sweep_command_args
    except ImportError:  # the same rules, for a wandb without this module
        return {"args": [f"--{k}={v['value']}" for k, v in params.items()]}
    return create_sweep_command_args({"args": params})


def _command_template(command: list) -> list:
    try:
        from wandb.sdk.launch.sweeps.utils import create_sweep_command
    except ImportError:
        return list(command)
    return create_sweep_command(list(command))


def render_commands(sweep: dict) -> list[tuple[dict, list[str]]]:
    """(parameter values, argv) for every run of a grid sweep, as ``wandb agent`` builds argv (``Agent._command_run``)."""
    assert sweep["method"] == "grid", "only grid sweeps can be enumerated"
    names, choices = [], []
    for name, spec in sweep["parameters"].items():
        assert "values" in spec or "value" in spec, f"{name}: a grid needs 'values' (or a constant 'value')"
        names.append(name)
        choices.append(spec["values"] if "values" in spec else [spec["value"]])
    out = []
    for combo in itertools.product(*choices):
        params = {n: {"value": v} for n, v in zip(names, combo)}
        macros = {
            **_args_macros(params),
            "env": ["/usr/bin/env"],
            "interpreter": ["python"],
            "program": [sweep["program"]],
        }
        argv: list[str] = []
        for c in _command_template(sweep["command"]):
            c = str(c)
            argv += (macros.get(c[2:-1]) or []) if c.startswith("${") and c.endswith("}") else [c]
        out.append((dict(zip(names, combo)), argv))
    return out


def _get(tree: dict, dotted: str):
    for part in dotted.split("."):
        tree = tree[part]
    return tree


def _print_config(args: list[str]) -> dict:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as exc:
        cli_main([*args, "--print_config"])
    assert exc.value.code in (None, 0), f"the CLI rejected {' '.join(args)}"
    return yaml.safe_load(buf.getvalue())


def test_the_sweeps_exist_with_the_papers_grids():
    beta = yaml.safe_load((REPO / "configs/sweeps/beta.yaml").read_text())
    kl = yaml.safe_load((REPO / "configs/sweeps/kl_beta.yaml").read_text())
    assert beta["parameters"]["model.init_args.method.init_args.diversity_beta"]["values"] == [0.1, 0.3, 0.5, 0.7, 0.9]
    assert kl["parameters"]["model.init_args.kl.coef"]["values"] == [0.0, 0.01, 0.04, 0.1]
    size = yaml.safe_load((REPO / "configs/sweeps/data_size.yaml").read_text())  # the paper's 400 -> 2,000 samples
    assert size["parameters"]["data.init_args.max_train_samples"]["values"] == [400, 800, 1200, 1600, 2000]


def test_render_follows_wandb_macros():
    sweep = {
        "method": "grid",
        "program": "train.py",
        "parameters": {"a.b": {"values": [1, 2]}, "c": {"value": "x"}},
        "command": ["${env}", "${interpreter}", "${program}", "fit", "${args}"],
    }
    assert [argv for _, argv in render_commands(sweep)] == [
        ["/usr/bin/env", "python", "train.py", "fit", "--a.b=1", "--c=x"],
        ["/usr/bin/env", "python", "train.py", "fit", "--a.b=2", "--c=x"],
    ]


SLOW_SWEEPS = {"toy_tuning_step2.yaml", "toy_tuning_step3_b4.yaml", "toy_tuning_step3_b16.yaml"}
"""Later steps of the toy tuning sweep, the same grid over other values (its first step runs by default): checked in
``make test-slow``."""


@pytest.mark.parametrize(
    "path",
    [pytest.param(p, marks=[pytest.mark.slow] if p.name in SLOW_SWEEPS else []) for p in SWEEPS],
    ids=lambda p: p.name,
)
def test_cli_accepts_every_sweep_command(path, monkeypatch):
    monkeypatch.chdir(REPO)  # wandb agent runs from the repository root: program and --config are relative to it
    sweep = yaml.safe_load(path.read_text())
    assert (REPO / sweep["program"]).is_file()
    runs = render_commands(sweep)
    assert len(runs) == len(list(itertools.product(*(s.get("values", [0]) for s in sweep["parameters"].values()))))
    for values, argv in runs:
        assert argv[:3] == ["/usr/bin/env", "python", sweep["program"]]
        args = argv[3:]
        assert args[0] == "fit" and any(
            a.startswith(("--model.init_args.", "--data.init_args.")) and "=" in a for a in args
        )
        printed = _print_config(args)
        for name, value in values.items():
            assert _get(printed, name) == pytest.approx(value), (name, argv)
        # the optimised metric is one the run logs: val/<a validation set of the config>/<metric>
        kind, set_name, metric = sweep["metric"]["name"].split("/")
        assert kind == "val" and metric in ("acc50", "miou", "map", "map_50", "gp", "gr")
        assert set_name in (printed["data"]["init_args"].get("val_files") or {}), sweep["metric"]["name"]


# ---------------------------------------------------------------------------------------------------------------------
# The offline runner: python -m runner.sweep
# ---------------------------------------------------------------------------------------------------------------------


def test_offline_runner_plans_one_folder_and_one_name_per_point(tmp_path):
    sweep, points, out = plan(REPO / "configs/sweeps/beta.yaml", tmp_path / "beta", ["--trainer.max_epochs", "1"])
    assert len(points) == 5 and out == tmp_path / "beta"
    assert [p.name for p in points] == [f"diversity_beta={b}" for b in (0.1, 0.3, 0.5, 0.7, 0.9)]
    assert len({p.folder for p in points}) == 5
    for p, (_, argv) in zip(points, render_commands(sweep)):
        assert p.argv[1:][: len(argv) - 2] == argv[2:]  # the command W&B's agent runs, minus env / interpreter
        assert f"--trainer.default_root_dir={p.folder}" in p.argv and f"--name=syn-grpo-beta-{p.name}" in p.argv
        assert p.argv[-2:] == ["--trainer.max_epochs", "1"]


def test_only_runs_a_subset_of_the_points(capsys):
    assert sweep_main([str(REPO / "configs/sweeps/beta.yaml"), "--dry-run", "--only", "diversity_beta=0.[15]"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split("--model.init_args.method.init_args.diversity_beta=")[1].split()[0] for ln in lines] == [
        "0.1",
        "0.5",
    ]
    assert sweep_main([str(REPO / "configs/sweeps/beta.yaml"), "--dry-run", "--only", "beta=2"]) == 2
    err = capsys.readouterr().err
    assert "matches no point" in err and "diversity_beta=0.9" in err  # the names to choose from


def test_a_running_point_reports_its_progress_between_start_and_done(tmp_path, capsys):
    """A long fit is not silent: every status_every seconds a [run  ] line names its last logged step."""
    metrics = tmp_path / "p" / "metrics.jsonl"
    code = (
        "import json, time\n"
        f"open({str(metrics)!r}, 'a').write(json.dumps({{'event': 'train', 'step': 7, 'epoch': 1}}) + '\\n')\n"
        "time.sleep(1.2)\n"
    )
    run_points([Point("p", {}, [sys.executable, "-c", code], folder=tmp_path / "p")], status_every=0.5)
    out = capsys.readouterr().out
    assert "[start] p" in out and "[done ] p: ok" in out
    assert "[run  ] p: 0 min, step 7, epoch 1" in out


def test_offline_runner_refuses_what_needs_a_server(tmp_path, capsys):
    bayes = tmp_path / "bayes.yaml"
    bayes.write_text(yaml.safe_dump({"method": "bayes", "program": "train.py", "parameters": {}, "command": []}))
    assert sweep_main([str(bayes)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error:") and "grid" in err and "\n" not in err


SHORT_POINT = [  # one GRPO step on 4 toy scenes, a 4-sample validation; no data server, no W&B
    "--trainer.max_epochs=1",
    "--trainer.enable_progress_bar=false",
    "--trainer.logger=false",
    "--data.init_args.toy.splits.train=4",
    "--data.init_args.max_eval_samples=4",
    "--data.init_args.val_files={toy_val: val.jsonl}",
    "--model.init_args.sampling.group_size=2",
    "--model.init_args.sampling.max_new_tokens=48",
    "--callbacks.synthesis=null",
    "--callbacks.gallery=null",
    "--callbacks.checkpoint=null",
    "--trainer.enable_checkpointing=false",
]


@pytest.mark.slow
def test_offline_sweep_of_five_points_two_at_a_time_feeds_the_notebook(tmp_path):
    """``python -m runner.sweep configs/sweeps/beta.yaml -j 2``: five points, each in its own folder, results collected, and
    the notebook's loader labels every point distinctly."""
    out = tmp_path / "beta"
    data = tmp_path / "toy"
    cmd = [sys.executable, "-m", "runner.sweep", "configs/sweeps/beta.yaml", "-j", "2", "--out", str(out), "--"]
    cmd += SHORT_POINT + [f"--data.init_args.data_root={data}"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1200)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    folders = sorted(p for p in out.iterdir() if p.is_dir())
    assert [p.name for p in folders] == [f"diversity_beta={b}" for b in (0.1, 0.3, 0.5, 0.7, 0.9)]
    for f in folders:
        assert (f / "metrics.jsonl").is_file() and (f / "config.yaml").is_file(), sorted(f.iterdir())
    results = pd.read_csv(out / "results.csv")
    assert results["returncode"].tolist() == [0] * 5 and "val/toy_val/acc50" in results
    runs = analysis.load_runs(str(out))
    assert len(runs) == 5 and len({r.label for r in runs}) == 5
    assert sorted(r.beta for r in runs) == [0.1, 0.3, 0.5, 0.7, 0.9]
    table = analysis.beta_table(runs)  # every point is a Syn-GRPO run: each has its final validation in the ablation
    assert sorted(set(table["beta"])) == [0.1, 0.3, 0.5, 0.7, 0.9] and table["acc50"].notna().all()
    fig = figures.plot_beta_ablation(runs)
    assert figures.save_figure(fig, tmp_path / "fig", "beta").stat().st_size > 1000
