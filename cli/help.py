"""The command line's help: example commands kept on their own lines, and a method's settings listed as flags that
can be pasted (``python train.py fit --model.method.help SynGRPO``).

jsonargparse prints a nested class's help with the flags relative to the module (``--method.diversity_beta``, which
the parser does not accept on its own) and only once the module's class is known (after a ``--config``); the method
help here needs neither and names every flag in full (``--model.method.diversity_beta``)."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from jsonargparse import ArgumentParser, DefaultHelpFormatter
from jsonargparse._actions import _ActionConfigLoad, remove_actions

from cli.errors import fail
from lightning_modules.methods.base import METHODS

METHOD_HELP = ("--model.method.help", "--model.init_args.method.help")


class HelpFormatter(DefaultHelpFormatter):
    """jsonargparse's help formatter, but a description keeps its line breaks (one example command per line)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


def method_help_value(args: Sequence[str]) -> tuple[bool, str | None]:
    """(asked, value) for ``--model.method.help [CLASS]`` (or ``--model.init_args.method.help``, ``=CLASS``)."""
    for i, tok in enumerate(args):
        flag, eq, value = tok.partition("=")
        if flag in METHOD_HELP:
            if eq:
                return True, value
            nxt = args[i + 1] if i + 1 < len(args) else None
            return True, nxt if nxt is not None and not nxt.startswith("-") else None
    return False, None


def resolve_method(value: str | None) -> type | None:
    """The method class a ``--model.method.help`` value names: a class name (``SynGRPO``), a registered name
    (``syn_grpo``) or an import path; None when it names none."""
    if not value:
        return None
    for name in METHODS:
        cls = METHODS[name]
        if value in (name, cls.__name__, f"{cls.__module__}.{cls.__name__}"):
            return cls
    return None


def print_method_help(value: str | None, prog: str = "train.py") -> None:
    """Print a method's settings as ``--model.method.<arg>`` flags, or the methods to choose from; exits (0 when the
    method is known, 2 when not, as for any flag mistake)."""
    cls = resolve_method(value)
    if cls is None:
        choices = ", ".join(f"{METHODS[n].__name__} ({n})" for n in METHODS)
        got = f" {value}: no such method;" if value else ": give a method;"
        fail(f"--model.method.help{got} choose one of {choices}")
    parser = ArgumentParser(prog=f"{prog} fit", formatter_class=HelpFormatter, print_config=None)
    parser.add_class_arguments(cls, "model.method", fail_untyped=False)
    remove_actions(parser, (_ActionConfigLoad,))  # --model.method CONFIG: a config file, not the method's name
    flags = [a.option_strings[0] for a in parser._actions if a.option_strings[0].startswith("--model.method.")]
    example = next((f for f in flags if f.endswith(".diversity_beta")), flags[0] if flags else None)
    parser.description = (
        f"The settings of the method {cls.__name__} (--model.method {cls.__name__}), as flags to paste after a config "
        f"whose model is GRPOModule, e.g.\n  python {prog} fit --config configs/tiny.yaml --model.method {cls.__name__}"
        + (f" {example} VALUE" if example else "")
        + "\n(in a config file: model.init_args.method.init_args.<name>)."
    )
    parser.print_help(sys.stdout)
    raise SystemExit(0)
