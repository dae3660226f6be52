"""The CLI's side of composed configs (``core/config_files.py``, docs/configs.md).

``--config configs/rec_7b.yaml`` hands the parser the file with its ``compose:`` parts merged in, exactly as if it
held the whole config, so stacking ``--config a.yaml --config overlay.yaml`` and flags after them work as before. A
file without ``compose:`` is read by jsonargparse itself, unchanged. jsonargparse composes only per argument (a
subclass's ``init_args`` from a file of its own), not a config from parts, hence this hook.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import Namespace
from jsonargparse import Path as ConfigPath
from jsonargparse._paths import change_to_path_dir  # private helpers (jsonargparse >= 4.49, pyproject.toml): a
from jsonargparse._util import load_config_path_context  # composed file's relative paths resolve as jsonargparse's own

from core.config_files import COMPOSE_KEY, ConfigFileError, config_sources, dump_config, load_config


def _composes(path: str | os.PathLike) -> bool:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except (OSError, TypeError, yaml.YAMLError):
        return False  # jsonargparse reports a file it cannot read or parse
    return isinstance(data, dict) and COMPOSE_KEY in data


def parse_composed_path(
    parser: Any, path: str | os.PathLike, parse_path: Callable[..., Namespace], *args: Any, **kwargs: Any
) -> Namespace:
    """``parser.parse_path(path, **kwargs)`` (passed in as ``parse_path``) for a config file, with its parts merged in
    when it composes. Relative paths inside it resolve against its own folder, as jsonargparse's do."""
    if not _composes(path):
        return parse_path(path, *args, **kwargs)
    try:
        text = dump_config(load_config(path))
    except ConfigFileError as e:
        parser.error(str(e))
    fpath = ConfigPath(path, mode="fr")
    with load_config_path_context(fpath), change_to_path_dir(fpath):
        return parser.parse_string(text, os.path.basename(path), *args, **kwargs)


def with_parts(config_files: Iterable[str | os.PathLike | None]) -> list[str]:
    """Each config file preceded by the parts it composes (merge order; ``core.config_files.config_sources``): where
    a value or a key is looked up for an error message (``cli.errors.locate_value``), a part counts as well."""
    out: list[str] = []
    for f in config_files:
        if f is None:
            continue
        try:
            out += [str(p) for p in config_sources(str(f))]
        except ConfigFileError:
            out.append(str(f))
    return out
