"""Named registries of plug-in classes (rollout / update engines, methods, data-evolution strategies).

A registry maps a name to a class. Built-ins are listed where the registry is made, as ``"module:Class"`` strings
with a one-line summary (`Registry.add`), and imported only when a run asks for them (`importlib`): the package that
defines an interface never imports its implementations, so an implementation may import anything below the interface
and no import cycle can form. A plug-in outside the package registers itself with ``@registry.register("name")``.
``registry.build(name, *args, **kwargs)`` constructs one with an error that names the flag, the choices and the file
to look in, instead of a bare ``KeyError`` or ``TypeError``; `Registry.describe` lists every entry for a ``--help``.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")

__all__ = ["Registry", "document"]


class Registry(Mapping[str, type[T]], Generic[T]):
    """``kind``: what it holds (``"method"``); ``flag``: the option that names one (``"--model.method"``);
    ``args_flag``: the option that carries its keyword arguments; ``where``: the folder or file of the built-ins.

    Reading an entry (``registry[name]``) imports its module on first use and sets the class's ``name``."""

    def __init__(self, kind: str, flag: str, args_flag: str, where: str) -> None:
        self.kind, self.flag, self.args_flag, self.where = kind, flag, args_flag, where
        self._entries: dict[str, type[T] | str] = {}
        self._summaries: dict[str, str] = {}

    def add(self, name: str, target: str, summary: str = "") -> None:
        """Register ``target`` (``"package.module:Class"``, imported on first use) as ``name``."""
        if ":" not in target:
            raise ValueError(f"{self.kind} {name!r}: target {target!r} is not 'package.module:Class'")
        self._entries[name] = target
        self._summaries[name] = summary

    def register(self, name: str, summary: str = ""):
        """Class decorator: make the class available as ``<flag> <name>``."""

        def deco(cls: type[T]) -> type[T]:
            cls.name = name  # type: ignore[attr-defined]
            self._entries[name] = cls
            self._summaries[name] = summary
            return cls

        return deco

    def __getitem__(self, name: str) -> type[T]:
        entry = self._entries[name]
        if isinstance(entry, str):
            module, _, attr = entry.partition(":")
            entry = getattr(importlib.import_module(module), attr)
            entry.name = name  # type: ignore[attr-defined]
            self._entries[name] = entry
        return entry

    def __contains__(self, name: object) -> bool:  # without importing the entry (Mapping's would read it)
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def get_class(self, name: str) -> type[T]:
        if name not in self:
            raise ValueError(
                f"{self.flag} {name!r} is not a registered {self.kind}; choose one of {sorted(self)} "
                f"({self.where}; register a new one with @register)"
            )
        return self[name]

    def build(self, name: str, *args: Any, **kwargs: Any) -> T:
        cls = self.get_class(name)
        try:
            return cls(*args, **kwargs)
        except TypeError as err:
            raise ValueError(f"{self.args_flag} {kwargs!r} do not fit {self.kind} {name!r}: {err}") from err

    def describe(self, classes: bool = False) -> str:
        """Every entry as ``name`` (summary), in registration order: the choices a flag's help lists. ``classes``: as
        ``Class`` (``name``, ``module``: summary), for a flag that takes a class (``--model.method``)."""
        if classes:
            items = []
            for n, s in self._summaries.items():
                entry = self._entries[n]
                module, cls = entry.split(":") if isinstance(entry, str) else (entry.__module__, entry.__qualname__)
                items.append(f"``{cls}`` (``{n}``, {module}" + (f": {s})" if s else ")"))
        else:
            items = [f"``{n}`` ({s})" if s else f"``{n}``" for n, s in self._summaries.items()]
        return ", ".join(items[:-1]) + f" or {items[-1]}" if len(items) > 1 else "".join(items)


def document(**registries: Registry):
    """Class decorator: replace each ``{key}`` of the class docstring by ``registries[key].describe()`` (by
    ``describe(classes=True)`` for a ``{key:classes}`` placeholder), so the help of a flag that names a plug-in lists
    every registered one (and cannot drift from the registry)."""

    def deco(cls):
        doc = cls.__doc__ or ""
        for key, registry in registries.items():
            doc = doc.replace("{" + key + ":classes}", registry.describe(classes=True))
            doc = doc.replace("{" + key + "}", registry.describe())
        cls.__doc__ = doc
        return cls

    return deco
