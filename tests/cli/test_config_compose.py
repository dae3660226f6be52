"""Configs compose from parts (core/config_files.py, docs/configs.md): every config composes to exactly what it held
before it was split into parts, no block of config lines is copied across files, and composing names its errors."""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path

import pytest

from core.config_files import ConfigFileError, config_sources, load_config, merge

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
SNAPSHOTS = REPO / "tests/data/config_snapshots"
CONFIG_FILES = sorted(p for p in CONFIGS.rglob("*.yaml") if "parts" not in p.relative_to(CONFIGS).parts)


def _rel(p: Path) -> str:
    return p.relative_to(CONFIGS).as_posix()


@pytest.mark.parametrize("path", CONFIG_FILES, ids=_rel)
def test_every_config_composes_to_its_snapshot(path):
    """The snapshots are every config's plain mapping as it was before the parts (main, c43156f): a part changed
    changes every config composed from it, and this says which. A new config gets its snapshot written with
    ``json.dumps(load_config(path), indent=1, sort_keys=True)``."""
    snapshot = SNAPSHOTS / Path(_rel(path)).with_suffix(".json")
    assert snapshot.is_file(), f"no snapshot for {_rel(path)}: write {snapshot.relative_to(REPO)}"
    composed = json.loads(json.dumps(load_config(path), sort_keys=True))
    assert composed == json.loads(snapshot.read_text(encoding="utf-8"))


def test_every_snapshot_has_its_config():
    names = {_rel(p) for p in CONFIG_FILES}
    assert {p.relative_to(SNAPSHOTS).with_suffix(".yaml").as_posix() for p in SNAPSHOTS.rglob("*.json")} <= names


def _config_lines(path: Path) -> list[str]:
    """The file's lines without comments, trailing blanks and blank lines."""
    lines = (re.sub(r"\s+#.*$", "", line).rstrip() for line in path.read_text(encoding="utf-8").splitlines())
    return [line for line in lines if line.strip() and not line.lstrip().startswith("#")]


def test_no_block_of_ten_config_lines_is_repeated_in_three_files():
    """A setting shared by several configs lives in one part (configs/parts/), not in copies."""
    seen: dict[tuple[str, ...], set[str]] = defaultdict(set)
    for path in sorted(CONFIGS.rglob("*.yaml")):
        lines = _config_lines(path)
        for i in range(len(lines) - 9):
            seen[tuple(lines[i : i + 10])].add(_rel(path))
    copied = {block: files for block, files in seen.items() if len(files) >= 3}
    assert not copied, "\n".join(f"{sorted(f)}:\n" + "\n".join(b) for b, f in list(copied.items())[:3])


def test_a_config_names_what_it_composes_and_the_paths_to_edit():
    """Opening rec_7b.yaml shows its parts and the keys a user edits."""
    text = (CONFIGS / "rec_7b.yaml").read_text(encoding="utf-8")
    assert "compose: [parts/task/rec.yaml, parts/model/qwen2_5_vl_7b.yaml, parts/hardware/gpu4_fsdp2.yaml]" in text
    assert ">>> EDIT THESE PATHS <<<" in text and text.count("# <<< EDIT") == 3
    assert [p.relative_to(CONFIGS).as_posix() for p in config_sources(CONFIGS / "rec_7b.yaml")] == [
        "parts/callbacks/paper.yaml",
        "parts/task/paper.yaml",
        "parts/task/outpaint.yaml",
        "parts/task/rec.yaml",
        "parts/model/qwen2_5_vl_7b.yaml",
        "parts/hardware/gpu4_fsdp2.yaml",
        "rec_7b.yaml",
    ]


def test_merge_later_wins_mappings_merge_lists_and_other_classes_replace():
    base = {"a": {"x": 1, "y": [1, 2]}, "m": {"class_path": "A", "init_args": {"p": 1}}, "k": 1}
    over = {"a": {"y": [3]}, "m": {"class_path": "B", "init_args": {"q": 2}}, "k": None}
    assert merge(base, over) == {"a": {"x": 1, "y": [3]}, "m": {"class_path": "B", "init_args": {"q": 2}}, "k": None}
    same = {"m": {"class_path": "A", "init_args": {"q": 2}}}
    assert merge(base, same)["m"] == {"class_path": "A", "init_args": {"p": 1, "q": 2}}


def test_parts_merge_in_order_then_the_file_and_relative_to_it(tmp_path):
    (tmp_path / "parts").mkdir()
    (tmp_path / "parts/a.yaml").write_text("x: 1\ny: {p: 1, q: 1}\n")
    (tmp_path / "parts/b.yaml").write_text("compose: [a.yaml]\ny: {q: 2}\nz: [1]\n")
    (tmp_path / "top.yaml").write_text("# a comment\ncompose: [parts/b.yaml]\nz: [2, 3]\n")
    assert load_config(tmp_path / "top.yaml") == {"x": 1, "y": {"p": 1, "q": 2}, "z": [2, 3]}


def test_a_missing_part_and_a_cycle_name_the_file_and_line(tmp_path):
    (tmp_path / "top.yaml").write_text("name: x\ncompose:\n  - a.yaml\n  - nope.yaml\n")
    (tmp_path / "a.yaml").write_text("k: 1\n")
    with pytest.raises(ConfigFileError, match=r"top\.yaml:4: compose: no part .*nope\.yaml"):
        load_config(tmp_path / "top.yaml")
    (tmp_path / "b.yaml").write_text("compose: [c.yaml]\n")
    (tmp_path / "c.yaml").write_text("compose: [b.yaml]\n")
    with pytest.raises(ConfigFileError, match=r"c\.yaml:1: compose: .*b\.yaml composes itself"):
        load_config(tmp_path / "b.yaml")
    (tmp_path / "bad.yaml").write_text("compose: {a: 1}\n")
    with pytest.raises(ConfigFileError, match=r"bad\.yaml:1: compose: expected a list"):
        load_config(tmp_path / "bad.yaml")


def test_the_cli_reports_a_missing_part_in_one_line(tmp_path, capsys):
    from train import cli_main

    (tmp_path / "top.yaml").write_text("compose: [parts/nope.yaml]\n")
    with pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--config", str(tmp_path / "top.yaml"), "--print_config"])
    assert exc.value.code == 2
    assert "top.yaml:1: compose: no part" in capsys.readouterr().err
