"""Every command line the W&B sweeps in configs/sweeps/ would run is accepted by the CLI and carries its value.

The grid is expanded here (W&B expands it server-side); the command is rendered with W&B's own macro code
(``wandb.sdk.launch.sweeps.utils``, what ``wandb agent`` calls) when it is importable, else with the same rules:
``${env}`` -> ``/usr/bin/env``, ``${interpreter}`` -> ``python``, ``${program}`` -> the program,
``${args}`` -> ``--<name>=<value>`` per parameter.
"""

from __future__ import annotations

import contextlib
import io
import itertools
from pathlib import Path

import pytest
import yaml

from train import cli_main

REPO = Path(__file__).resolve().parents[1]
SWEEPS = sorted((REPO / "configs/sweeps").glob("*.yaml"))


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


def test_the_two_sweeps_exist_with_the_papers_grids():
    beta = yaml.safe_load((REPO / "configs/sweeps/beta.yaml").read_text())
    kl = yaml.safe_load((REPO / "configs/sweeps/kl_beta.yaml").read_text())
    assert beta["parameters"]["model.init_args.diversity_beta"]["values"] == [0.1, 0.3, 0.5, 0.7, 0.9]
    assert kl["parameters"]["model.init_args.kl_coef"]["values"] == [0.0, 0.01, 0.04, 0.1]


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


@pytest.mark.parametrize("path", SWEEPS, ids=lambda p: p.name)
def test_cli_accepts_every_sweep_command(path, monkeypatch):
    monkeypatch.chdir(REPO)  # wandb agent runs from the repository root: program and --config are relative to it
    sweep = yaml.safe_load(path.read_text())
    assert (REPO / sweep["program"]).is_file()
    runs = render_commands(sweep)
    assert len(runs) == len(list(itertools.product(*(s.get("values", [0]) for s in sweep["parameters"].values()))))
    for values, argv in runs:
        assert argv[:3] == ["/usr/bin/env", "python", sweep["program"]]
        args = argv[3:]
        assert args[0] == "fit" and any(a.startswith("--model.init_args.") and "=" in a for a in args)
        printed = _print_config(args)
        for name, value in values.items():
            assert _get(printed, name) == pytest.approx(value), (name, argv)
        # the optimised metric is one the run logs: val/<a validation set of the config>/<metric>
        kind, set_name, metric = sweep["metric"]["name"].split("/")
        assert kind == "val" and metric in ("acc50", "miou", "map", "map_50", "gp", "gr")
        assert set_name in (printed["data"]["init_args"].get("val_files") or {}), sweep["metric"]["name"]
