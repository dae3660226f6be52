"""notebooks/collapse_curves.ipynb runs (nbclient) on the metrics file of a tiny GRPO fit and writes its PNG figures;
the analysis functions behind it on their own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import nbformat
import pandas as pd
import pytest
import yaml

from runner import analysis, figures
from runner.outputs import figures_dir
from runner.runs import Run
from runner.wandb_runs import load_wandb_api
from train import cli_main

REPO = Path(__file__).resolve().parents[2]
NOTEBOOK = REPO / "notebooks/collapse_curves.ipynb"
FIGURES = ("collapse", "rewards", "accuracy_per_epoch", "beta_ablation", "evolution", "evolution_by_epoch")


def _tiny_fit(model_dir: Path, data_root: Path, out: Path, run_name: str) -> Path:
    """2 GRPO steps on the tiny model (1 batch per epoch, 2 epochs), a validation after each; the metrics file."""
    cfg = {
        "seed_everything": 0,
        "trainer": {
            "accelerator": "cpu",
            "devices": 1,
            "max_epochs": 2,
            "limit_train_batches": 1,
            "log_every_n_steps": 1,
            "num_sanity_val_steps": 0,
            "enable_model_summary": False,
            "enable_progress_bar": False,
            "enable_checkpointing": False,
            "default_root_dir": str(out),
            "logger": False,
            "callbacks": [{"class_path": "callbacks.logging.MetricsJSONL", "init_args": {"run_name": run_name}}],
        },
        "model": {
            "class_path": "lightning_modules.grpo.GRPOModule",
            "init_args": {
                "policy": {"model_name_or_path": str(model_dir), "dtype": "fp32"},
                "sampling": {"prompt_template": "toy", "group_size": 3, "max_new_tokens": 12},
                "engines": {"micro_batch_size": 6},
                "method": {
                    "class_path": "lightning_modules.methods.syn_grpo.SynGRPO",
                    "init_args": {"diversity_beta": 0.7},
                },
            },
        },
        "data": {
            "class_path": "datamodules.rec.RECDataModule",
            "init_args": {
                "data_root": str(data_root),
                "train_files": ["train.jsonl"],
                "val_files": {"rec_val": "val.jsonl"},
                "batch_size": 2,
                "eval_batch_size": 4,
            },
        },
    }
    path = out.parent / "fit.yaml"
    path.write_text(yaml.safe_dump(cfg))
    cli_main(["fit", "--config", str(path)])
    return out / "metrics.jsonl"


def _variant(src: Path, dst: Path, run: str, **hparams) -> Path:
    """A second run for the plots: the same curves shifted, another name and hparams (a beta-sweep point)."""
    rows = [json.loads(line) for line in src.read_text().splitlines()]
    for r in rows:
        if r["event"] == "start":
            r["run"], r["hparams"] = run, {**r["hparams"], **hparams}
        for k, v in list(r.items()):
            if isinstance(v, float) and k.startswith(("train/", "val/")):
                r[k] = v * 0.5 + 0.1
    dst.parent.mkdir(parents=True, exist_ok=True)
    dst.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return dst


def _ensure_python3_kernel() -> None:
    from jupyter_client.kernelspec import KernelSpecManager

    if "python3" not in KernelSpecManager().find_kernel_specs():
        subprocess.run([sys.executable, "-m", "ipykernel", "install", "--user"], check=True, capture_output=True)


def test_notebook_is_stored_without_outputs():
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code and all(not c.outputs and c.execution_count is None for c in code)
    assert "parameters" in code[0].metadata.get("tags", [])  # papermill can inject RUNS / OUT


def test_notebook_executes_on_a_tiny_run_and_writes_figures(tiny_model_dir, rec_dir, tmp_path, monkeypatch):
    from nbclient import NotebookClient

    metrics = _tiny_fit(tiny_model_dir, rec_dir, tmp_path / "syn-grpo", "syn-grpo")
    other = _variant(metrics, tmp_path / "beta03/metrics.jsonl", "syn-grpo-beta0.3", diversity_beta=0.3)
    out = tmp_path / "figures"
    monkeypatch.setenv("RUNS", f"{metrics},{other.parent}")
    monkeypatch.setenv("OUT", str(out))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_RUNS", raising=False)
    _ensure_python3_kernel()

    nb = nbformat.read(NOTEBOOK, as_version=4)
    NotebookClient(
        nb, timeout=120, kernel_name="python3", resources={"metadata": {"path": str(NOTEBOOK.parent)}}
    ).execute()

    for name in FIGURES:
        png = out / f"{name}.png"
        assert png.is_file() and png.stat().st_size > 1000, png
    text = "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code" for o in c.outputs)
    assert "2 run(s)" in text


def test_beta_ablation_reads_hparams_and_skips_grpo_baselines():
    def run(name, beta, weight, acc):
        return Run(
            name=name,
            hparams={"diversity_beta": beta, "diversity_weight": weight},
            val=pd.DataFrame(
                {"step": [1, 2], "epoch": [0, 1], "stage": ["fit", "fit"], "val/toy_val/acc50": [0.0, acc]}
            ),
        )

    runs = [run("b1", 0.1, 1.0, 0.4), run("b7", 0.7, 1.0, 0.6), run("grpo", 0.7, 0.0, 0.2)]
    table = analysis.beta_table(runs)
    assert table[["beta", "acc50"]].values.tolist() == [[0.1, 0.4], [0.7, 0.6]]  # final value; GRPO left out
    assert Run(name="syn-grpo-beta0.9").beta == 0.9  # from the name when the hparams lack it
    assert (
        Run(name="x", hparams={"model.init_args.method.init_args.diversity_beta": 0.5}).beta == 0.5
    )  # W&B sweep config
    # today's hparams: the method is a plug-in block; a study of GRPO and Syn-GRPO rows keeps only the Syn-GRPO ones
    plugin = {
        "syn": {"class_path": "lightning_modules.methods.syn_grpo.SynGRPO", "init_args": {"diversity_beta": 0.3}},
        "grpo": {"class_path": "lightning_modules.methods.grpo.GRPO", "init_args": {"diversity_beta": 0.7}},
    }
    runs = [run("s3", 0.3, 1.0, 0.5), run("g7", 0.7, 1.0, 0.1)]
    runs[0].hparams = {"method": plugin["syn"]}
    runs[1].hparams = {"method": plugin["grpo"]}
    assert [analysis.method_plugin(r) for r in runs] == ["syn_grpo", "grpo"]
    assert analysis.beta_table(runs)[["beta", "acc50"]].values.tolist() == [[0.3, 0.5]]


@pytest.mark.parametrize("spec,expected", [("a.jsonl,b", ["a.jsonl", "b"]), (" a \n b ", ["a", "b"]), (None, [])])
def test_split_spec(spec, expected):
    assert analysis.split_spec(spec) == expected


def test_figures_go_beside_the_runs_unless_out_says_otherwise():
    """The README's notebook line names a sweep folder (RUNS and --output-dir): its figures land there, not in a
    fixed outputs/figures."""
    assert figures_dir("outputs/sweeps/syn-grpo-beta") == "outputs/sweeps/syn-grpo-beta/figures"
    assert figures_dir("outputs/tiny/metrics.jsonl") == "outputs/tiny/figures"
    assert figures_dir("grpo=outputs/grpo,syn-grpo=outputs/tiny") == "outputs/figures"
    assert figures_dir("wandb:e/p/r") == "outputs/figures"


def test_wandb_api_is_skipped_without_a_key(monkeypatch, capsys):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    assert load_wandb_api(["entity/project/abc123"]) == []
    assert "skipped" in capsys.readouterr().out


def test_evolution_curves_pool_seeds_per_method_and_read_epoch_levels():
    def run(name, level=None):
        train = pd.DataFrame({"step": [1, 2, 3], "train/diversity/zero_frac": [0.5, 0.6, 0.7]})
        epochs = pd.DataFrame()
        if level is not None:
            train["train/level/mean"] = [0.0, level, level + 1]
            epochs = pd.DataFrame({"epoch": [0, 1], "step": [2, 3], "synth/level/mean": [level, level + 1]})
        return Run(name=name, train=train, epochs=epochs)

    runs = [run("grpo-seed0"), run("grpo-seed1"), run("evolved_grpo-seed0", 1.0), run("evolved_grpo-seed1", 2.0)]
    per_step, per_epoch = figures.plot_evolution_by_method(runs)
    level_ax, zero_ax = per_step.axes[0], per_step.axes[1]
    assert [line.get_label() for line in level_ax.get_lines()] == ["evolved_grpo (n=2)"]
    assert list(level_ax.get_lines()[0].get_ydata()) == [0.0, 1.5, 2.5]  # mean over the two seeds
    assert sorted(line.get_label() for line in zero_ax.get_lines()) == ["evolved_grpo (n=2)", "grpo (n=2)"]
    reroll_ax = per_step.axes[list(figures.EVOLUTION_KEYS).index("train/level/reroll/frac")]
    assert reroll_ax.get_lines() == []  # no run re-generated groups: an empty panel, not an error
    (line,) = per_epoch.axes[0].get_lines()
    assert list(line.get_xdata()) == [0, 1] and list(line.get_ydata()) == [1.5, 2.5]


def test_runs_of_different_lengths_are_never_averaged_together():
    def run(name, n, value):
        return Run(name=name, train=pd.DataFrame({"step": range(1, n + 1), "train/diversity/zero_frac": [value] * n}))

    runs = [run("grpo-seed0", 4, 0.2), run("grpo-seed1", 4, 0.4), run("grpo-seed2", 8, 0.9)]
    fig = figures.plot_evolution_by_method(runs)[0]
    ax = fig.axes[list(figures.EVOLUTION_KEYS).index("train/diversity/zero_frac")]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert set(lines) == {"grpo, 4 steps (n=2)", "grpo, 8 steps (n=1)"}
    assert list(lines["grpo, 4 steps (n=2)"].get_xdata()) == [1, 2, 3, 4]
    assert list(lines["grpo, 4 steps (n=2)"].get_ydata()) == pytest.approx([0.3] * 4)  # the two 4-step seeds only
    assert list(lines["grpo, 8 steps (n=1)"].get_ydata()) == pytest.approx([0.9] * 8)
