"""What the CLI checks of the config's paths before a run chooses its folder, so that a failed launch leaves no trace:
the model folder (a toy checkpoint git does not keep names the make target that builds it; a local folder without
``config.json`` names the config line to edit) and the data root (a missing JSONL folder; a toy world written only
into an empty or toy-made folder). Each stops with one line and its class's exit status (`cli.errors.EXIT_CODES`)."""

from __future__ import annotations

from pathlib import Path

from jsonargparse import Namespace

from cli.compose import with_parts
from cli.errors import EXIT_CODES, fail, locate_value
from cli.toy_checkpoints import missing_checkpoint_message
from datamodules.toy_export import ForeignFolderError, check

MODEL_FLAG = "--model.init_args.policy.model_name_or_path"


def looks_local(path: str) -> bool:
    """Whether a model path means a folder on this machine rather than a hub id (``org/name``): the path exists here,
    it starts with ``/``, ``./``, ``../`` or ``~``, or it has more than one slash (no hub id has). ``Qwen/X`` is a hub
    id even where the working directory has a ``Qwen/`` folder, as long as ``Qwen/X`` itself is not there."""
    return Path(path).exists() or path.startswith(("/", "./", "../", "~")) or path.count("/") > 1


def has_model(path: str) -> bool:
    """Whether the folder ``path`` holds a model (a ``save_pretrained`` directory: its ``config.json``)."""
    return (Path(path).expanduser() / "config.json").is_file()


def check_paths(cfg: Namespace) -> None:
    """One sentence (flag, file:line, what to do) for the paths people forget to edit, from the parsed config of a
    subcommand (``cfg``)."""
    files = with_parts(cfg.get("config") or [])  # a composed config's parts are searched too
    model = cfg.get("model")
    args = model.get("init_args") if isinstance(model, Namespace) else None
    policy = args.get("policy") if args is not None else None  # GRPOModule's and SFTModule's policy group
    path = policy.get("model_name_or_path") if policy is not None else None
    if path and not args.get("build_tiny") and (missing := missing_checkpoint_message(path)):
        fail(missing, EXIT_CODES["model"])  # a toy checkpoint git does not keep: the make target that builds it
    if path and looks_local(str(path)) and not args.get("build_tiny") and not has_model(path):
        where = locate_value(str(path), files)
        fail(
            f"{MODEL_FLAG} {path}: no model there (no config.json)"
            + (f"; edit {where} and point it" if where else "; point it")
            + f" at a local copy of the model (a save_pretrained directory), or pass {MODEL_FLAG} DIR",
            EXIT_CODES["model"],
        )
    data = cfg.get("data")
    dargs = data.get("init_args") if isinstance(data, Namespace) else None
    root = dargs.get("data_root") if dargs is not None else None
    if root and dargs.get("toy"):  # the toy world is written there: only into an empty or toy-made folder
        try:
            check(root)
        except ForeignFolderError as e:
            fail(str(e))
    if root and not dargs.get("toy") and not Path(root).exists():
        where = locate_value(str(root), files)
        fail(
            f"--data.init_args.data_root {root}: no such folder"
            + (f"; edit {where} to point it" if where else "; point it")
            + " at your JSONL files (docs/interfaces.md), or pass --data.init_args.data_root DIR",
            EXIT_CODES["data"],
        )
