"""Registries of engines and methods: lazy "module:Class" entries, the flag's help lists every one, and the interfaces
never import their implementations (so the package's imports stay acyclic)."""

from __future__ import annotations

import ast
import subprocess
import sys
import types

import pytest

from core.registry import Registry, document
from lightning_modules.engines.base import ROLLOUT_ENGINES, UPDATE_ENGINES
from lightning_modules.grpo import GRPOModule
from lightning_modules.methods.base import METHODS


def test_an_entry_is_imported_when_first_read_and_named_by_the_registry(monkeypatch):
    plugins = types.ModuleType("fake_plugins")

    class Thing:
        def __init__(self, size: int = 1):
            self.size = size

    plugins.Thing = Thing
    reg = Registry("thing", "--model.thing", "--model.thing_args", "nowhere/")
    reg.add("big", "fake_plugins:Thing", "a big thing")
    assert "big" in reg and list(reg) == ["big"] and len(reg) == 1
    with pytest.raises(ModuleNotFoundError):  # not imported before it is read
        reg["big"]
    monkeypatch.setitem(sys.modules, "fake_plugins", plugins)
    assert reg["big"] is Thing and Thing.name == "big"
    assert reg.build("big", size=3).size == 3
    with pytest.raises(ValueError, match=r"--model.thing 'nope' is not a registered thing; choose one of \['big'\]"):
        reg.build("nope")
    with pytest.raises(ValueError, match=r"--model.thing_args \{'colour': 1\} do not fit thing 'big'"):
        reg.build("big", colour=1)
    with pytest.raises(ValueError, match="not 'package.module:Class'"):
        reg.add("bad", "fake_plugins.Thing")


def test_describe_lists_every_entry_and_document_fills_the_docstring():
    reg = Registry("thing", "--model.thing", "--model.thing_args", "nowhere/")
    reg.add("a", "collections:OrderedDict", "first")
    reg.add("b", "collections:Counter")
    reg.add("c", "collections:deque", "third")
    assert reg.describe() == "``a`` (first), ``b`` or ``c`` (third)"

    @document(things=reg)
    class Documented:
        """thing: one of {things}; {mode: x} stays."""

    assert Documented.__doc__ == "thing: one of ``a`` (first), ``b`` or ``c`` (third); {mode: x} stays."


def test_grpo_module_help_names_every_registered_method_and_engine():
    from lightning_modules.grpo.args import EngineArgs

    doc, engines = GRPOModule.__doc__, EngineArgs.__doc__
    classes = ("SynGRPO", "GRPO", "CycleGRPO", "EvolvedGRPO", "EvolvedSynGRPO")
    assert set(METHODS) >= {"syn_grpo", "grpo", "cycle_grpo", "evolved_grpo", "evolved_syn_grpo"}
    assert all(f"``{c}`` (``" in doc for c in classes)  # the class a config names, and the registered name
    for reg, names in ((ROLLOUT_ENGINES, ("hf", "hf_shared", "fast", "vllm")), (UPDATE_ENGINES, ("hf", "packed"))):
        assert set(names) <= set(reg)  # tests may register more after the module was documented
        assert all(f"``{n}`` (" in engines for n in names)
    assert "{methods" not in doc and "{rollout_engines}" not in engines


def test_every_built_in_entry_resolves_to_its_kind():
    from lightning_modules.engines.base import RolloutEngine, UpdateEngine
    from lightning_modules.methods.base import Method

    for reg, base in ((ROLLOUT_ENGINES, RolloutEngine), (UPDATE_ENGINES, UpdateEngine), (METHODS, Method)):
        for name in reg:
            assert issubclass(reg[name], base) and reg[name].name == name


def test_interfaces_do_not_import_their_implementations_nor_the_loop():
    """Importing the engine and method interfaces (what every implementation imports) loads no engine, no method and
    not the training loop: the package's import graph has no cycle through them."""
    code = (
        "import sys; import lightning_modules.engines.base, lightning_modules.methods.base; "
        "print(sorted(m for m in sys.modules if m.startswith('lightning_modules')))"
    )
    loaded = ast.literal_eval(
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    )
    assert not [m for m in loaded if m.startswith(("lightning_modules.grpo", "lightning_modules.sft"))], loaded
    engines = {"fast", "hf", "packed", "vllm", "decode", "packing", "vllm_backend"}
    assert not [m for m in loaded if m.rpartition(".")[2] in engines], loaded
    assert not [
        m for m in loaded if m.startswith("lightning_modules.methods.") and m != "lightning_modules.methods.base"
    ]
