"""The README's commands, read from the README itself, run as written (the GPU lines on the CPU with the toy model and
toy data swapped in, as tests/cli/test_config_runs.py swaps them; the notebook through the README's nbconvert line);
and every command of the README and docs/*.md (blocks, indented blocks and inline spans), read from the text, parses
as written (``train.py`` through its own parser, modules and scripts through their argparse parser, ``make`` targets
in the Makefile), the few not run listed in ``EXEMPT`` with the reason."""

from __future__ import annotations

import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import yaml
from test_config_runs import compose, cpu_swap, toy_data  # noqa: F401 - toy_data is a fixture

from runner.sweep import main as sweep_main
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
    kinds = ("make ", "python train.py ", "python -m runner.sweep ", "wandb sweep ", "RUNS=", "python -m synth.server ")
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


@pytest.mark.slow
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
    (argv,) = _commands("python -m runner.sweep ")
    assert sweep_main([*argv[3:], "--dry-run"]) == 0
    points = capsys.readouterr().out.splitlines()
    assert len(points) == 2 and all("train.py fit --config configs/tiny.yaml" in p for p in points)
    (online,) = _commands("wandb sweep ")
    sweep = yaml.safe_load((REPO / online[2]).read_text())
    assert sweep["program"] == "train.py" and shutil.which("wandb", path=str(Path(sys.executable).parent))


@pytest.mark.slow
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


# ---------------------------------------------------------------------------------------------------------------------
# Every command of the README and docs/*.md, from the text: its program exists and its arguments parse as written
# ---------------------------------------------------------------------------------------------------------------------

DOCS = [README, *sorted((REPO / "docs").glob("*.md"))]
PROGRAMS = ("python ", "make ", "jupyter ", "wandb ", "torchrun ", "srun ", "bash ", "papermill ")
ENV = re.compile(r"^(?:[A-Z_]+=\S*\s*)+")
EXEMPT = {
    "wandb ": "talks to a W&B server (an account, the network); the sweep files are checked by tests/runner/test_sweeps.py",
    "papermill ": "executes the notebook as the README's nbconvert line does, which runs here",
    "jupyter ": "executes the notebook on runs made first; the README's line runs (test_the_notebook_line_...), the "
    "others differ in RUNS / OUT only",
    "bash dev_study.sh": "names a way of launching a study (a script of one's own), not a file of the repository",
    "python -m cli.*": "a pattern for every cli module, not one command",
    "python -m cli.evaluate vstar | dove": "a heading that names two benchmarks; their commands follow and run",
    "python -m pytest": "the FSDP tests on GPUs (FSDP_TEST_ACCELERATOR=gpu); the suite runs the same tests on the CPU",
    "python tests/fsdp_probe.py ...": "its other flags are elided (...); tests/cli/test_fsdp.py runs the probe",
}
"""Commands not run, by prefix, with the reason."""
PLACEHOLDERS = {
    "<the row's configs>": "configs/tiny.yaml",
    "<config>": "configs/tiny.yaml",
    "<base config>": "configs/tiny.yaml",
    "configs/toy_sft_stage_<x>.yaml": "configs/toy_sft_stage2.yaml",
    "<study.yaml>": "experiments/study/table1_toy.yaml",
}
"""Placeholders that must name a real file (the parser reads config files); other <...> / CAPS words stay strings."""


def doc_commands() -> list[tuple[str, str]]:
    """(file, command) for every command of the README and docs/: the lines of ```bash (and unlabelled) blocks that
    start with a program, and every `inline span` that does; env assignments kept, trailing comments dropped."""
    out = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for lang, block in re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
            if lang in ("", "bash", "sh"):
                for line in block.replace("\\\n", " ").splitlines():
                    line = " ".join(line.split(" #", 1)[0].split())
                    if ENV.sub("", line).startswith(PROGRAMS):
                        out.append((path.name, line))
        prose = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
        for line in re.findall(r"^ {4}(\S.*(?:\\\n.*)*)", prose.replace("\\\n", " "), flags=re.M):  # indented blocks
            line = " ".join(line.split("  #", 1)[0].split())
            if ENV.sub("", line).startswith(PROGRAMS):
                out.append((path.name, line))
        for span in re.findall(r"`([^`]+)`", prose):
            span = " ".join(span.split())
            if re.fullmatch(r"--[\w.]+\.help \w+", span):  # a help flag in prose: `--model.method.help SynGRPO`
                span = f"python train.py fit {span}"
            if ENV.sub("", span).startswith(PROGRAMS):
                out.append((path.name, span))
    return out


def concrete(command: str, run_config: str, before: dict[tuple[str, ...], list[str]]) -> list[str]:
    """The command's argv with the docs' notation resolved: env assignments and launchers (srun, torchrun: one
    process here, a dry run) dropped, ``[optional]`` groups dropped, ``a | b`` -> ``a``, ``...`` after a flag -> a
    value, ``...`` after a subcommand -> the flags of the last full command of that program and subcommand (``gres
    ... --shard 3/8``), and the placeholders that must name a file -> a real one."""
    cmd = ENV.sub("", command)
    cmd = re.sub(r"^srun .*?(?=python )", "", cmd)
    cmd = re.sub(r"^torchrun .*?(?=train\.py )", "python ", cmd)
    for k, v in {**PLACEHOLDERS, "outputs/<run>/config.yaml": run_config}.items():
        cmd = cmd.replace(k, v)
    cmd = re.sub(r"(?<=\s)\[[^\]]*\]", "", cmd)
    cmd = re.sub(r"(\S+) \| \S+", r"\1", cmd)
    argv: list[str] = []
    elided = False
    for tok in shlex.split(cmd):
        if tok == "...":
            if argv and argv[-1].startswith("-") and "=" not in argv[-1]:
                argv.append("PLACEHOLDER")
            elif not elided and tuple(argv) in before:
                argv += before[tuple(argv)]
                elided = True
            continue
        argv.append(tok)
    if "..." not in command and len(argv) > 3:
        before[tuple(argv[:4])] = argv[4:]  # python -m <module> <subcommand>: its flags, for a later "..."
    return argv


class _Parsed(Exception):
    """Raised by argparse's ``parse_args`` once a command line parsed: the command stops before it does anything."""


def _parses(argv: list[str], monkeypatch) -> str | None:
    """None when ``python ...`` argv's program exists and its arguments parse (argparse), else why not."""
    import argparse
    import runpy

    parse, parse_known = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    inside = []

    def parse_only(self, args=None, namespace=None):
        inside.append(1)
        parse(self, args, namespace)
        raise _Parsed

    def parse_known_only(self, args=None, namespace=None):
        got = parse_known(self, args, namespace)
        if inside:  # called by parse_args, which checks what is left
            return got
        raise _Parsed

    with monkeypatch.context() as m:
        m.setattr(argparse.ArgumentParser, "parse_args", parse_only)
        m.setattr(argparse.ArgumentParser, "parse_known_args", parse_known_only)
        m.setattr(sys, "argv", argv[1:] if argv[1] != "-m" else argv[2:])
        m.setattr(warnings, "filters", list(warnings.filters))  # runpy's note on a module imported already
        warnings.simplefilter("ignore", RuntimeWarning)
        try:
            if argv[1] == "-m":
                runpy.run_module(argv[2], run_name="__main__", alter_sys=False)
            else:
                runpy.run_path(str(REPO / argv[1]), run_name="__main__")
        except _Parsed:
            return None
        except SystemExit as e:
            return None if e.code in (0, None) else f"exit {e.code}"
    return "ran without parsing its arguments"


def _train_parses(argv: list[str], parser) -> str | None:
    """None when ``python train.py ...`` parses as written (a bare subcommand: its ``--help``)."""
    args = argv[2:] + (["--help"] if len(argv) == 3 else [])
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        try:
            parser.parse_args(args)
        except SystemExit as e:
            return None if e.code in (0, None) and buf.getvalue() else f"exit {e.code}"
    return None


def _train_parser():
    """train.py's parser, built once (``SynGRPOCLI`` stopped before it parses)."""
    from cli.main import SynGRPOCLI

    class ParserOnly(SynGRPOCLI):
        def parse_arguments(self, parser, args):
            ParserOnly.parser = parser
            raise _Parsed

    with contextlib.suppress(_Parsed):
        ParserOnly(args=["fit"])
    return ParserOnly.parser


@pytest.fixture(scope="module")
def run_config(tmp_path_factory) -> str:
    """A run folder's ``config.yaml`` (what ``outputs/<run>/config.yaml`` in a command stands for): the tiny config as
    the CLI resolves it, written without a fit (the README's fits run in ``make test-slow``)."""
    path = tmp_path_factory.mktemp("run") / "config.yaml"
    path.write_text(yaml.safe_dump(compose((REPO / "configs/tiny.yaml",)), sort_keys=False))
    return str(path)


def test_every_command_of_the_readme_and_the_docs_runs_as_written(run_config, monkeypatch, capsys):
    """Each command parses as written, with the placeholders filled: ``train.py`` lines through ``--print_config``
    (GPU and cluster lines as a one-process dry run: the parse does not touch a device), ``python -m`` modules and
    scripts through their argparse parser (stopped there), ``make`` targets in the Makefile. The fits and the
    notebook of the README run for real above (``make test-slow``); EXEMPT lists what is not run, with the reason."""
    status = ["git", "status", "--porcelain", "--untracked-files=all"]
    tree_before = subprocess.run(status, cwd=REPO, capture_output=True, text=True).stdout
    makefile = (REPO / "Makefile").read_text()
    targets = set(re.findall(r"^([\w.-]+):", makefile, flags=re.M))
    commands = doc_commands()
    parser = _train_parser()
    assert len(commands) >= 100, "the extraction found too few commands"
    seen, failures, exempt_used, before = set(), [], set(), {}
    for where, command in commands:
        exempt = next((p for p in EXEMPT if ENV.sub("", command).startswith(p)), None)
        if exempt:
            exempt_used.add(exempt)
            continue
        argv = concrete(command, run_config, before)
        if tuple(argv) in seen:
            continue
        seen.add(tuple(argv))
        t0 = time.perf_counter()
        if argv[0] == "make":
            why = next((f"no Makefile target {t}" for t in argv[1:] if "=" not in t and t not in targets), None)
        elif argv[:2] == ["python", "train.py"]:
            why = _train_parses(argv, parser)
        else:  # a module or a script named without arguments: its --help
            why = _parses(argv + ["--help"] if argv[1:2] == ["-m"] and len(argv) == 3 else argv, monkeypatch)
        capsys.readouterr()
        if os.environ.get("DOCS_COMMANDS_TIMES"):
            print(f"{time.perf_counter() - t0:6.2f} s  {' '.join(argv)}", file=sys.__stderr__)
        if why:
            failures.append(f"{where}: {command} -> {' '.join(argv)}: {why}")
    assert not failures, "\n".join(failures)
    tree_after = subprocess.run(status, cwd=REPO, capture_output=True, text=True).stdout
    assert tree_after == tree_before, "a docs command wrote into the repository (it must stop after its parse)"
    assert exempt_used == set(EXEMPT), f"exemptions no command uses any more: {set(EXEMPT) - exempt_used}"
