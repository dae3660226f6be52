"""Named registries of plug-in classes (rollout / update engines, methods, data-evolution strategies).

A registry maps a name to a class; ``@registry.register("name")`` adds one (and sets its ``name``), and
``registry.build(name, *args, **kwargs)`` constructs it with an error that names the flag, the choices and the file to
look in, instead of a bare ``KeyError`` or ``TypeError``.
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

T = TypeVar("T")

__all__ = ["Registry"]


class Registry(dict[str, type[T]], Generic[T]):
    """``kind``: what it holds (``"method"``); ``flag``: the option that names one (``"--model.method"``);
    ``args_flag``: the option that carries its keyword arguments; ``where``: the folder or file of the built-ins."""

    def __init__(self, kind: str, flag: str, args_flag: str, where: str) -> None:
        super().__init__()
        self.kind, self.flag, self.args_flag, self.where = kind, flag, args_flag, where

    def register(self, name: str):
        """Class decorator: make the class available as ``<flag> <name>``."""

        def deco(cls: type[T]) -> type[T]:
            cls.name = name  # type: ignore[attr-defined]
            self[name] = cls
            return cls

        return deco

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
