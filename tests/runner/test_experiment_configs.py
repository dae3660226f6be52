"""Every study file under ``experiments/study/`` parses: the study runner reads it, and one fit and one evaluation
command line of it are accepted by ``train.py`` (``--print_config``: no weights, no checkpoint needed). The held-out
overlays parse on the configs they overlay. Which studies reproduce a published table by real fit steps:
tests/runner/test_study.py (``test_a_row_of_each_new_study_fits_real_steps``)."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_study import _print_config  # the config the CLI composes for a command line

from runner.study_file import load_study
from runner.study_plan import HELDOUT, HELDOUT_VIDEO, plan

REPO = Path(__file__).resolve().parents[2]
OVERLAYS = {REPO / HELDOUT: "configs/tiny.yaml", REPO / HELDOUT_VIDEO: "configs/cycle_tiny_temporal.yaml"}
STUDIES = sorted(p for p in (REPO / "experiments/study").glob("*.yaml") if p not in OVERLAYS)


def test_the_study_folder_holds_the_studies_and_the_overlays():
    assert {p.name for p in OVERLAYS} == {"heldout.yaml", "heldout_video.yaml"} and all(p.is_file() for p in OVERLAYS)
    assert len(STUDIES) >= 25 and REPO / "experiments/study/table1_toy.yaml" in STUDIES
    assert not (REPO / "configs/study").exists()  # the product's configs/ holds no study


@pytest.mark.parametrize("path", STUDIES, ids=lambda p: p.stem)
def test_a_study_file_parses_and_its_command_lines_are_accepted(path, tmp_path, monkeypatch):
    monkeypatch.chdir(REPO)
    study = load_study(path)
    runs, data_root = plan(study, tmp_path / "out")
    assert runs and {r.row.name for r in runs} == {r.name for r in study.rows}
    fit = next((r for r in reversed(runs) if r.train is not None), None)
    if fit is not None:  # the last trained row: ablation overrides come last
        cfg = _print_config(fit.train.argv[2:])
        assert cfg["seed_everything"] == fit.seed and cfg["trainer"]["default_root_dir"] == str(fit.work)
    ev = [a for a in runs[0].evaluate.argv[2:] if not a.startswith("--ckpt_path")]
    cfg = _print_config(ev)
    assert cfg["data"]["init_args"]["data_root"] == str(data_root)
    assert set(cfg["data"]["init_args"]["toy"]["splits"]) == set(study.test_splits)


@pytest.mark.parametrize("overlay", list(OVERLAYS), ids=lambda p: p.stem)
def test_the_held_out_overlays_parse_on_their_base(overlay, monkeypatch):
    monkeypatch.chdir(REPO)
    cfg = _print_config(["test", "--config", OVERLAYS[overlay], "--config", str(overlay)])
    data = cfg["data"]["init_args"]
    assert data["max_eval_samples"] is None and all(s.startswith("test") for s in data["toy"]["splits"])
