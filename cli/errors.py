"""One-line errors for the common mistakes on the command line and in configs.

The parser's own messages for an unknown flag or a bad choice are a usage dump of dozens of lines, or a chained
traceback; ``explain`` turns them into one sentence that names the flag and says what to do, with a did-you-mean.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import re
import sys
import typing
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import NoReturn

import yaml


class ConfigError(ValueError):
    """A mistake in the command line or a config file: the message names the flag (and file) and the fix."""


EXIT_CODES = {"config": 2, "data": 3, "model": 4, "memory": 5, "interrupted": 130}
"""One exit status per class of error: 2 a flag or config file (argparse's usage status), 3 a data file, 4 a model
that cannot be loaded (a path without weights, a hub id with no local copy) or a judge endpoint that does not answer
(``judge.on_failure: raise``); 5 a CUDA out-of-memory error (`cli.oom`: the card, the measured peak, what lowers it);
130 a run stopped by Ctrl-C (the shell's 128 + SIGINT; the checkpoint saved and the resume command printed); 1 is an
unexpected error (a bug), which keeps its traceback (``cli.main.error_class``)."""


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: <message>`` on stderr and exit with status ``code`` (2, argparse's status for usage errors, by
    default; :data:`EXIT_CODES` has the others)."""
    sys.stderr.write(f"error: {message}\n")
    sys.stderr.flush()
    raise SystemExit(code)


def init_flags(classes: Iterable[type], prefix: str) -> list[str]:
    """``--<prefix>.init_args.<arg>`` and ``--<prefix>.<arg>`` for every ``__init__`` argument of ``classes``."""
    out: list[str] = []
    for cls in classes:
        try:
            params = inspect.signature(cls.__init__).parameters
        except (TypeError, ValueError):
            continue
        try:
            hints = typing.get_type_hints(cls.__init__)
        except Exception:  # an annotation that does not resolve here: the group's fields are not listed
            hints = {}
        for name, p in params.items():
            if name == "self" or p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
                continue
            out += [f"--{prefix}.init_args.{name}", f"--{prefix}.{name}"]
            if dataclasses.is_dataclass(hints.get(name)):  # a typed group: its fields too
                for f in dataclasses.fields(hints[name]):
                    out += [f"--{prefix}.init_args.{name}.{f.name}", f"--{prefix}.{name}.{f.name}"]
    return out


def did_you_mean(flag: str, known: Sequence[str]) -> str:
    """`` (did you mean --x?)`` for the closest known flag, or an empty string."""
    close = difflib.get_close_matches(flag, [k for k in known if k != flag], n=1, cutoff=0.75)
    return f" (did you mean {close[0]}?)" if close else ""


_UNRECOGNIZED = re.compile(r"unrecognized arguments: (?P<args>.+)", re.IGNORECASE)
_KEYS = re.compile(r'Parser key "(?P<key>[^"]+)"')
_NOT_ACCEPTED = re.compile(r"Option '(?P<opt>[^']+)' is not accepted")
_LITERAL = re.compile(r"Expected a (?:typing\.)?Literal\[(?P<choices>[^\]]*)\]\.? ?(?:Got value: (?P<value>\S+))?")
_NO_CLASS = re.compile(r"Expected a dot import path string: (?P<name>\S+)|No module named '(?P<module>[^']+)'")
_NO_FILE = re.compile(r'Parser key "config": File does not exist: (?P<path>.+)')
_SUBCOMMAND = re.compile(r"invalid choice: '(?P<got>[^']+)' \(choose from (?P<choices>[^)]+)\)")


def _flag(keys: list[str]) -> str:
    """``--model.init_args.aggregation`` from the parser's nested keys ``["model", "aggregation"]``."""
    return "--" + keys[0] + "".join(f".init_args.{k}" for k in keys[1:])


def _no_hint(flag: str) -> str:
    return ""


def explain(
    message: str, known_flags: Sequence[str], prog: str = "train.py", moved: Callable[[str], str] = _no_hint
) -> str:
    """One sentence for a parser error ``message`` (the flag, what is wrong, what to do). ``moved(flag)`` is the hint
    for an unknown flag that an earlier version took (where it lives now), given instead of a did-you-mean;
    ``cli.main`` passes ``cli.flat_flags.moved_hint``."""
    raw = str(message)
    text = " ".join(raw.split())
    m = _UNRECOGNIZED.search(text)
    if m:
        name = m["args"].split()[0].split("=", 1)[0]
        outer = _KEYS.findall(raw)[:1]  # a nested parser's message names the flag without its class's key
        if outer and name.startswith("--") and not name.startswith(f"--{outer[0]}."):
            name = f"--{outer[0]}.{name[2:]}"
        hint = moved(name) or (did_you_mean(name, known_flags) if name.startswith("--") else "")
        return f"unknown flag {name}{hint}; `python {prog} <subcommand> --help` lists the flags"
    m = _SUBCOMMAND.search(text)
    if m:
        choices = [c.strip().strip("'") for c in m["choices"].split(",")]
        close = difflib.get_close_matches(m["got"], choices, n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return f"unknown subcommand {m['got']!r}{hint}; choose one of {', '.join(choices)}"
    m = _NO_FILE.search(text)
    if m:
        return (
            f"--config {m['path'].strip(chr(39))}: no such file; the configs are in configs/ (e.g. configs/tiny.yaml)"
        )
    keys = _KEYS.findall(raw)
    m = _NOT_ACCEPTED.search(text)
    if m and keys:
        flag = _flag([*keys, m["opt"]])  # every nesting level: --model.init_args.method.init_args.<opt>
        hint = moved(flag) or did_you_mean(flag, known_flags)
        return f"unknown flag {flag}{hint}; `python {prog} fit --{keys[0]}.help CLASS` lists them"
    m = _LITERAL.search(text)
    if m and keys:
        allowed = ", ".join(c.strip().strip("'\"") for c in m["choices"].split(","))
        got = f" got {m['value']!r};" if m["value"] else ""
        return f"{_flag(keys)}:{got} choose one of {allowed}"
    m = _NO_CLASS.search(text)
    if m and keys:
        name = m["name"] or m["module"]
        return (
            f"--{keys[0]} {name}: no such class; give a class name (e.g. GRPOModule, RECDataModule) or a full import "
            f"path (lightning_modules.grpo.GRPOModule); `python {prog} fit --{keys[0]}.help CLASS` lists its arguments"
        )
    if keys:
        lines = [ln.strip(" -") for ln in raw.splitlines() if ln.strip(" -") and "Parser key" not in ln]
        skip = ("Does not validate", "Subtypes", "Errors", "Given", "Problem with given class_path")
        reasons = [ln for ln in lines if not ln.startswith(skip) and "NoneType" not in ln]
        reason = _plain_type_error(reasons[0]) if reasons else text
        hint = (
            f"; `python {prog} fit --{keys[0]}.help CLASS` lists its arguments and their types" if len(keys) > 1 else ""
        )
        return f"{_flag(keys)}: {reason}{hint}"
    return text


_EXPECTED = re.compile(r"Expected a <class '(?P<type>[\w.]+)'>\.?(?: Got value: (?P<value>.*))?")


def _plain_type_error(line: str) -> str:
    """``Expected a <class 'int'>. Got value: abc`` -> ``expected an int, got 'abc'``."""
    m = _EXPECTED.fullmatch(line.strip())
    if not m:
        return line
    kind = m["type"].rsplit(".", 1)[-1]
    article = "an" if kind[:1] in "aeiou" else "a"
    got = f", got {m['value']!r}" if m["value"] is not None else ""
    return f"expected {article} {kind}{got}"


def locate_value(value: str, config_files: Iterable[str | Path]) -> str:
    """``file:line`` of the last config file whose text contains ``value`` (where the user should edit), or ``""``."""
    where = ""
    for f in config_files:
        try:
            lines = Path(f).read_text(encoding="utf-8").splitlines()
        except OSError:
            continue
        for i, line in enumerate(lines, 1):
            if value and value in line:
                where = f"{f}:{i}"
    return where


_NOT_ACCEPTED_BY = re.compile(
    r"(?:Group '(?P<group>[^']+)'|Subcommand '[^']+') does not accept option '(?P<opt>[^']+)'"
)


def unknown_key(message: str) -> list[str] | None:
    """The unknown key of a parser error as its path without ``init_args`` (``["model", "kl", "coeff"]``), or None."""
    raw = str(message)
    keys = _KEYS.findall(raw)
    m = _NOT_ACCEPTED_BY.search(raw)
    if m:
        return [*keys, *(m["group"].split(".") if m["group"] else []), *m["opt"].split(".")]
    m = _NOT_ACCEPTED.search(raw)
    return [*keys, *m["opt"].split(".")] if m and keys else None


def locate_key(path: Sequence[str], config_files: Iterable[str | Path]) -> tuple[str, int, list[str]] | None:
    """(file, line, the key's path as written there) of ``path`` in the last config file that has it; ``init_args``
    levels in the file are skipped over (``model.init_args.kl.coeff`` is ``["model", "kl", "coeff"]``)."""

    def find(node, rest: list[str], seen: list[str]):
        if not isinstance(node, yaml.MappingNode):
            return None
        for k, v in node.value:
            if k.value == rest[0]:
                if len(rest) == 1:
                    return k.start_mark.line + 1, [*seen, k.value]
                if (hit := find(v, rest[1:], [*seen, k.value])) is not None:
                    return hit
            elif k.value == "init_args" and (hit := find(v, rest, [*seen, k.value])) is not None:
                return hit
        return None

    found = None
    for f in config_files:
        try:
            node = yaml.compose(Path(f).read_text(encoding="utf-8"))
        except (OSError, yaml.YAMLError):
            continue
        if path and (hit := find(node, list(path), [])) is not None:
            found = (str(f), hit[0], hit[1])
    return found


def config_key_error(message: str, config_files: Sequence[str], argv: Sequence[str], known_flags: Sequence[str]):
    """``FILE:LINE: unknown key ... (did you mean ...?)`` when the parser's unknown key comes from a config file (not
    from a flag on the command line), else None."""
    path = unknown_key(message)
    flags = [tok.split("=", 1)[0] for tok in argv if tok.startswith("--")]
    if not path or any(f.endswith(f".{path[-1]}") for f in flags):  # the key came from a flag: explain() names it
        return None
    hit = locate_key(path, config_files)
    if hit is None:
        return None
    file, line, written = hit
    close = difflib.get_close_matches("--" + ".".join(path), known_flags, n=1, cutoff=0.75)
    hint = f" (did you mean {close[0].rsplit('.', 1)[-1]}?)" if close else ""
    if path[0] not in ("model", "data"):
        return f"{file}:{line}: unknown key {'.'.join(written)}{hint}; `python train.py fit --help` lists the keys"
    where = ".".join(written[:-1])
    group = "model.method" if path[:2] == ["model", "method"] else path[0]
    under = f" under {where}" if where else ""
    lister = f"`python train.py fit --{group}.help CLASS` lists the keys"
    return f"{file}:{line}: unknown key {written[-1]}{under}{hint}; {lister}"
