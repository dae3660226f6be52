"""Config files that compose: a ``compose:`` list of parts, merged before the file's own keys.

A config under ``configs/`` names the parts it is made of and then sets its own keys::

    compose: [parts/task/rec.yaml, parts/model/qwen2_5_vl.yaml, parts/hardware/gpu4_fsdp2.yaml]
    name: rec_7b
    model: {init_args: {policy: {model_name_or_path: /path/to/Qwen2.5-VL-7B-Instruct}}}

Part paths are relative to the file that names them; a part may compose parts of its own. The parts merge in the
order listed, then the file's own keys on top (:func:`merge`: later wins, mappings merge key by key, lists are
replaced). The result is the plain mapping a copy of the whole config would have held, so the CLI
(``cli/compose.py``) and every other reader of a config's YAML (the study, sweep and co-evolution runners, the
benchmarks, the tests) see one config, never the ``compose:`` key. A file without ``compose:`` reads as it is.

Only the standard library and PyYAML: the low layer, which the CLI and the tooling both import.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

COMPOSE_KEY = "compose"
"""The key of a config file that lists its parts."""


class ConfigFileError(ValueError):
    """A config file that cannot be composed: a part missing, a cycle, a ``compose:`` that is not a list of paths.
    The message names the file and line."""


def merge(base: Any, over: Any) -> Any:
    """``over`` on top of ``base``: mappings merge key by key (recursively), anything else (a list, a scalar,
    ``null``) replaces. A mapping whose ``class_path`` differs from the one below replaces it whole, so a config
    that swaps a class never inherits the arguments of the class it replaced."""
    if not isinstance(base, Mapping) or not isinstance(over, Mapping):
        return over
    if over.get("class_path") and base.get("class_path") and over["class_path"] != base["class_path"]:
        return dict(over)
    out = dict(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if key in out else value
    return out


def _parts(path: Path, text: str, data: dict[str, Any]) -> list[tuple[Path, int]]:
    """(resolved path, line) of each part ``path`` names under ``compose:``."""
    listed = data.get(COMPOSE_KEY)
    node = yaml.compose(text)
    line = next((k.start_mark.line + 1 for k, _ in node.value if k.value == COMPOSE_KEY), 1)
    if isinstance(listed, str):
        listed = [listed]
    if not isinstance(listed, list) or not all(isinstance(p, str) for p in listed):
        raise ConfigFileError(f"{path}:{line}: {COMPOSE_KEY}: expected a list of part paths, got {listed!r}")
    items = next(v for k, v in node.value if k.value == COMPOSE_KEY)
    lines = [n.start_mark.line + 1 for n in items.value] if isinstance(items, yaml.SequenceNode) else [line]
    return [(Path(os.path.normpath(path.parent / p)), at) for p, at in zip(listed, lines, strict=True)]


def _read(path: Path) -> tuple[str, dict[str, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigFileError(f"{path}: cannot read it ({e.strerror or e})") from e
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigFileError(f"{path}: not valid YAML ({e})") from e
    if data is None:
        return text, {}
    if not isinstance(data, dict):
        raise ConfigFileError(f"{path}: a config is a mapping of keys, got {type(data).__name__}")
    return text, data


def _compose(path: Path, chain: tuple[Path, ...], files: list[Path]) -> dict[str, Any]:
    text, data = _read(path)
    if COMPOSE_KEY not in data:
        files.append(path)
        return data
    merged: dict[str, Any] = {}
    for part, line in _parts(path, text, data):
        if part.resolve() in {p.resolve() for p in (*chain, path)}:
            cycle = " -> ".join(str(p) for p in (*chain, path, part))
            raise ConfigFileError(f"{path}:{line}: {COMPOSE_KEY}: {part} composes itself ({cycle})")
        if not part.is_file():
            raise ConfigFileError(f"{path}:{line}: {COMPOSE_KEY}: no part {part} (paths are relative to {path.parent})")
        merged = merge(merged, _compose(part, (*chain, path), files))
    files.append(path)
    return merge(merged, {k: v for k, v in data.items() if k != COMPOSE_KEY})


def load_config(path: str | Path) -> dict[str, Any]:
    """The config at ``path`` with its parts merged in (the module docstring), as a plain mapping without the
    ``compose:`` key; ``{}`` for an empty file. Raises :class:`ConfigFileError` naming the file and line."""
    return _compose(Path(path), (), [])


def config_sources(path: str | Path) -> list[Path]:
    """The files the config at ``path`` is read from, in merge order: each part after the parts it composes, and
    ``path`` itself last (the file whose keys win). A part composed twice is listed once, where it first merges."""
    files: list[Path] = []
    _compose(Path(path), (), files)
    return list(dict.fromkeys(files))


def dump_config(data: Mapping[str, Any]) -> str:
    """``data`` as YAML text in the order its keys were written (what the CLI's parser reads for a composed file)."""
    return yaml.safe_dump(dict(data), sort_keys=False, allow_unicode=True, width=1_000_000)
