"""``python train.py fit|validate|test|predict|export --config configs/<name>.yaml [--flag value ...]``.

LightningCLI (``parser_mode="omegaconf"``) with what a researcher needs on top (docs/outputs.md, docs/decisions.md):

* **One folder and one name per run.** ``name`` (and ``method``, which baseline overlays set) make the run name
  ``<name>[-<method>]``; the run folder is ``outputs/<run name>`` unless ``--trainer.default_root_dir`` says otherwise,
  and every output hangs off it: checkpoints, ``metrics.jsonl``, ``config.yaml``, W&B, synthesized images, galleries,
  results, predictions. Runs never mix (`cli.run_folder`): a new fit whose folder holds a run takes ``<run name>-v1``,
  a ``--ckpt_path`` inside a run folder continues there; Ctrl-C saves a checkpoint and prints the resume command.
* **Named callbacks.** ``callbacks:`` is a mapping ``name -> callback``: a later ``--config`` (an overlay) or a flag
  patches one entry's ``init_args``, replaces it (a new ``class_path``), adds one (a new name) or removes one (``null``)
  without dropping the rest. ``trainer.callbacks`` still works and is kept.
* **Export.** ``train.py export --config ... --ckpt_path ... --out DIR`` writes the trained policy as an HF directory
  (processor, generation config, prompt template, model card) without building the frozen reference.
* **Errors in one line** for the common mistakes (unknown flag with a did-you-mean, bad choice, missing path), no flag
  abbreviations, short class names (``--model.help GRPOModule``).
* **W&B** starts after the model loads (a wrong model path leaves no empty run), gets the full resolved config, and a
  resumed fit continues the same W&B run.

The parts beside it: `cli.run_folder` (folders, Ctrl-C, the closing lines), `cli.run_config` (the config copy and
W&B's run config), `cli.path_checks` and `cli.resume_checks` (what is checked before a run starts), `cli.errors` (the
one-line messages and exit codes), `cli.help`, `cli.export`, and `cli.flat_flags` (all that is left of the flat
``GRPOModule`` arguments).
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import warnings
from pathlib import Path
from typing import Any

# Lightning's and W&B's notes that do not apply here (the tip to install litlogger; the git root of a checkout run)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# GRPO's shapes change every step (prompt and completion lengths); expandable segments keep the caching allocator from
# fragmenting near the memory limit (the 3B one-GPU config peaks at ~113 GiB). Set before CUDA initialises.
os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
os.environ.setdefault("WANDB_DISABLE_GIT", "true")
os.environ.setdefault("WANDB_DISABLE_CODE", "true")
warnings.filterwarnings("ignore", message=".*ModelCheckpoint with manual optimization.*")
warnings.filterwarnings("ignore", message=".*isinstance\\(treespec, LeafSpec\\).*")


class _DropNotes(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "litlogger" not in record.getMessage()


logging.getLogger("lightning.pytorch.utilities.rank_zero").addFilter(_DropNotes())

import lightning as L  # noqa: E402
import torch  # noqa: E402
from jsonargparse import Namespace  # noqa: E402
from jsonargparse._common import debug_mode_active  # noqa: E402
from lightning.fabric.utilities.rank_zero import rank_zero_only  # noqa: E402
from lightning.pytorch.callbacks import Callback  # noqa: E402
from lightning.pytorch.callbacks.progress import ProgressBar  # noqa: E402
from lightning.pytorch.cli import LightningArgumentParser, LightningCLI  # noqa: E402

# the project's callbacks, modules and data modules are imported here so that their short class names resolve
import callbacks.completions  # noqa: E402, F401
import callbacks.logging  # noqa: E402, F401
import callbacks.predictions  # noqa: E402, F401
import callbacks.progress  # noqa: E402, F401
import callbacks.results  # noqa: E402, F401
import callbacks.synthesis  # noqa: E402, F401
from callbacks.checkpoint_disk import CheckpointDisk  # noqa: E402
from cli.compose import parse_composed_path, with_parts  # noqa: E402
from cli.errors import EXIT_CODES, ConfigError, config_key_error, explain, fail, init_flags  # noqa: E402
from cli.export import export_policy  # noqa: E402
from cli.flat_flags import checkpoint_init_args, moved_hint  # noqa: E402
from cli.help import HelpFormatter, method_help_value, print_method_help  # noqa: E402
from cli.oom import Measured, OutOfMemory, oom_line  # noqa: E402
from cli.path_checks import check_paths  # noqa: E402
from cli.resume_checks import checkpoint_temps, finished_run_line, intact_checkpoint  # noqa: E402
from cli.run_config import RunConfigCallback  # noqa: E402
from cli.run_folder import RunEnd, choose_run_folder, print_end, remember_folder  # noqa: E402
from core.config_files import ConfigFileError, load_config  # noqa: E402
from core.records import DataError  # noqa: E402
from datamodules.rec import RECDataModule  # noqa: E402
from datamodules.synthetic import SyntheticDataModule  # noqa: E402
from lightning_modules.grpo import GRPOModule  # noqa: E402
from lightning_modules.judge import JudgeUnavailable  # noqa: E402
from lightning_modules.methods.base import METHODS  # noqa: E402
from lightning_modules.sft import SFTModule  # noqa: E402

PROJECT_HELP = """\
Syn-GRPO. Start from a config and change single values with flags:
  python train.py fit --config configs/tiny.yaml --model.method.init_args.diversity_beta 0.5
  python train.py fit --config configs/tiny.yaml --config configs/baselines/grpo.yaml    # a baseline: outputs/tiny-grpo/
  python train.py test --config configs/tiny.yaml --ckpt_path outputs/tiny/checkpoints/last.ckpt
  python train.py export --config configs/tiny.yaml --ckpt_path outputs/tiny/checkpoints/last.ckpt --out DIR
Project options: --name / --method (the run and its folder outputs/<name>[-<method>]/), --callbacks.<name>
(named callbacks: checkpoint, synthesis, metrics, gallery, results, progress, completions, predictions; null removes
one). A module's own arguments: --model.help GRPOModule (or SFTModule); a method's: --model.method.help SynGRPO;
data: --data.help SyntheticDataModule.
Errors print one line and exit 2 (a flag or config), 3 (a data file) or 4 (a model that cannot be loaded); Ctrl-C
saves a checkpoint and exits 130 (docs/outputs.md, "Exit status"); --debug shows the traceback."""

RUN_ROOT = "outputs"
"""Run folders go under this folder (relative to the working directory) unless --trainer.default_root_dir is set."""


def _project_classes() -> dict[str, list[type]]:
    """The project's modules and data modules, with every method class imported (the registry imports each on first
    use), so that short class names resolve (``--model GRPOModule``, ``--model.help GRPOModule``, ``--model.method
    GRPO``)."""
    for name in METHODS:
        METHODS[name]
    return {"model": [GRPOModule, SFTModule], "data": [RECDataModule, SyntheticDataModule]}


def run_name(name: str | None, method: str | None) -> str:
    """``<name>-<method>`` (a baseline overlay's method), ``<name>`` alone, or ``run``."""
    base = name or "run"
    return f"{base}-{method}" if method else base


# ---------------------------------------------------------------------------------------------------------------------
# Parser: no abbreviations, one-line errors
# ---------------------------------------------------------------------------------------------------------------------


class ProjectParser(LightningArgumentParser):
    """``LightningArgumentParser`` with OmegaConf interpolation, no flag abbreviations (``--trainer.max_step`` is an
    error, not ``--trainer.max_steps``) and one-line errors (``cli.errors.explain``)."""

    _argv: list[str] = []
    """The command line last parsed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("parser_mode", "omegaconf")
        kwargs.setdefault("allow_abbrev", False)
        kwargs["formatter_class"] = HelpFormatter  # subcommands take the top parser's: examples keep their lines
        super().__init__(*args, **kwargs)

    def parse_args(self, args: Any = None, *a: Any, **kw: Any) -> Namespace:
        args = list(sys.argv[1:] if args is None else args)
        ProjectParser._argv = args  # for error(): a key of a config file is named with its file and line
        asked, value = method_help_value(args)
        if asked and "--help" not in args and "-h" not in args:
            print_method_help(value)  # the flags in full, with or without a --config (cli/help.py)
        return super().parse_args(merge_named_callbacks(args), *a, **kw)

    def parse_path(self, path: Any, *args: Any, **kwargs: Any) -> Namespace:
        """A config file with its ``compose:`` parts merged in (cli/compose.py)."""
        return parse_composed_path(self, path, super().parse_path, *args, **kwargs)

    def _known_flags(self) -> list[str]:
        flags = [s for a in self._actions for s in a.option_strings if s.startswith("--")]
        classes = _project_classes()
        methods = [METHODS[name] for name in METHODS]
        return (
            flags
            + init_flags(classes["model"], "model")
            + init_flags(classes["data"], "data")
            + init_flags(methods, "model.method")
            + init_flags(methods, "model.init_args.method")
        )

    def error(self, message: str, ex: Exception | None = None):  # type: ignore[override]
        if not self.exit_on_error or debug_mode_active():  # the parent's switch (JSONARGPARSE_DEBUG)
            return super().error(message, ex)
        parser = getattr(ex, "subcommand_parser", None) or self
        known = parser._known_flags() if isinstance(parser, ProjectParser) else []
        argv = ProjectParser._argv
        in_file = config_key_error(message, with_parts(f for _, f in _config_files(argv)), argv, known)
        fail(in_file or explain(message, known, moved=moved_hint))


def _config_files(args: list[str]) -> list[tuple[int, str]]:
    """(index of the last token, path) of every ``--config`` / ``-c`` in ``args``."""
    out = []
    for i, tok in enumerate(args):
        if tok in ("--config", "-c") and i + 1 < len(args):
            out.append((i + 1, args[i + 1]))
        elif tok.startswith("--config="):
            out.append((i, tok.split("=", 1)[1]))
    return out


def merge_callback_entry(old: Any, new: Any) -> Any:
    """One named callback of a later config over an earlier one: ``None`` removes it, another ``class_path`` replaces
    it, otherwise ``init_args`` are patched key by key."""
    if new is None or not isinstance(old, dict) or not isinstance(new, dict):
        return new
    if new.get("class_path") and old.get("class_path") and new["class_path"] != old["class_path"]:
        return new
    merged = {**old, **{k: v for k, v in new.items() if k != "init_args"}}
    init = {**(old.get("init_args") or {}), **(new.get("init_args") or {})}
    if init:
        merged["init_args"] = init
    return merged


def merge_named_callbacks(args: list[str]) -> list[str]:
    """Make ``callbacks:`` of several ``--config`` files merge by name.

    jsonargparse replaces a mapping given by a later config file (keeping only the keys it names); the project's
    overlays patch one callback and expect the others to stay. The mappings of the config files so far are merged
    (``merge_callback_entry``) and given to the parser once more right after each config file from the second that
    names callbacks: a later overlay's patch (``checkpoint: {init_args: ...}``, no ``class_path``) then meets the whole
    mapping, whatever overlay came before it, and flags after the last file (``--callbacks.synthesis.init_args.mode
    off``) still apply on top."""
    merged: dict[str, Any] = {}
    seen = 0
    out: list[str] = []
    at = 0
    for end, path in _config_files(args):
        out += args[at : end + 1]
        at = end + 1
        try:
            data = load_config(path)
        except ConfigFileError:
            continue  # the parser reports it
        named = data.get("callbacks") if isinstance(data, dict) else None
        if not isinstance(named, dict):
            continue
        seen += 1
        for key, entry in named.items():
            merged[key] = merge_callback_entry(merged.get(key), entry) if key in merged else entry
        if seen >= 2:
            out += ["--callbacks", json.dumps(merged)]
    return args if seen < 2 else [*out, *args[at:]]


# ---------------------------------------------------------------------------------------------------------------------
# Trainer: the export subcommand
# ---------------------------------------------------------------------------------------------------------------------


class Trainer(L.Trainer):
    """``lightning.Trainer`` plus the run's name and the ``export`` subcommand."""

    run_name: str | None = None
    """The run's name (set by the CLI): the W&B run, the metrics file's ``run``, the results tables' row."""

    def export(
        self,
        model: L.LightningModule,
        datamodule: L.LightningDataModule | None = None,
        ckpt_path: str | None = None,
        out: str | None = None,
        weights_only: bool | None = None,
    ) -> Path:
        """Write the trained policy of a checkpoint as an HF model directory (without building the reference).

        Args:
            model: the module of the config (its hyper-parameters come from the checkpoint).
            datamodule: unused (the config's data section may stay as it is).
            ckpt_path: the Lightning checkpoint to export; none exports the config's model as loaded.
            out: the output directory (default ``<run folder>/export``).
            weights_only: ``torch.load``'s, as Lightning's ``fit`` / ``test`` take it (a run's saved ``config.yaml``
                names it, so it exports as it is); ``None`` or ``false`` reads the whole checkpoint.
        """
        out = out or Path(self.default_root_dir) / "export"
        path = export_policy(model, ckpt_path, out, run_name=self.run_name, weights_only=bool(weights_only))
        print(f"exported {ckpt_path or 'the configured model'} to {path}", flush=True)
        return path


# ---------------------------------------------------------------------------------------------------------------------
# The CLI
# ---------------------------------------------------------------------------------------------------------------------


class SynGRPOCLI(LightningCLI):
    """LightningCLI with run folders, named callbacks, ``export``, one-line errors (module docstring)."""

    def __init__(self, args: list[str] | None = None, run: bool = True, **kwargs: Any) -> None:
        _project_classes()
        self._args = [str(a) for a in args] if isinstance(args, list) else None
        super().__init__(
            L.LightningModule,
            L.LightningDataModule,
            subclass_mode_model=True,
            subclass_mode_data=True,
            trainer_class=Trainer,
            parser_class=ProjectParser,
            save_config_callback=RunConfigCallback,
            args=args,
            run=run,
            **kwargs,
        )

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        return {**LightningCLI.subcommands(), "export": {"model", "datamodule"}}

    def _prepare_subcommand_parser(self, klass: type, subcommand: str, **kwargs: Any) -> LightningArgumentParser:
        kwargs["description"] = f"{kwargs.get('description') or subcommand}\n\n{PROJECT_HELP}"
        parser = super()._prepare_subcommand_parser(klass, subcommand, **kwargs)
        if subcommand in ("validate", "test"):
            parser.set_defaults(verbose=False)  # callbacks.results.ResultsTable prints the table (once)
        if subcommand == "predict":
            parser.set_defaults(return_predictions=False)  # callbacks.predictions writes them
        return parser

    def add_arguments_to_parser(self, parser: LightningArgumentParser) -> None:
        parser.add_argument(
            "--name",
            type=str | None,
            default=None,
            help="Run name (W&B run, metrics file, results row). The run folder is outputs/<name>[-<method>] unless "
            "--trainer.default_root_dir is set.",
        )
        parser.add_argument(
            "--method",
            type=str | None,
            default=None,
            help="Method of a baseline overlay (grpo, sft, ...): appended to the run name, so a baseline never "
            "writes into the base run's folder.",
        )
        parser.add_argument(
            "--callbacks",
            type=dict[str, Callback | None],
            default={},
            help="Named callbacks: a later config or flag patches, replaces, adds or removes (null) one by name "
            "(e.g. --callbacks.synthesis.init_args.mode off).",
        )
        parser.add_argument(
            "--measured",
            type=Measured | None,
            default=None,
            help="What the config was measured at (card, peak_gib, s_per_step, date): named in an out-of-memory error.",
        )
        parser.add_argument(
            "--resume_intact",
            type=bool,
            default=False,
            help="When --ckpt_path is damaged (a truncated file, changed bytes, a distributed checkpoint with a shard "
            "missing or changed) or missing, use the newest intact checkpoint in its folder (printing one line that "
            "names it) instead of stopping with an error that names it.",
        )

    # ------------------------------------------------------------------------------------------------ run folder
    def _sub(self) -> Namespace:
        return self.config[self.subcommand] if self.subcommand else self.config

    def before_instantiate_classes(self) -> None:
        cfg = self._sub()
        if cfg.get("name") is None:  # a config without a name: a W&B logger's explicit name names the run
            cfg.name = next((lg.init_args.get("name") for lg in _logger_specs(cfg) if "Wandb" in lg.class_path), None)
        check_paths(cfg)  # before choosing a folder: a failed launch leaves no trace (cli/path_checks.py)
        given, ckpt = cfg.trainer.get("default_root_dir"), cfg.get("ckpt_path")
        name = run_name(cfg.get("name"), cfg.get("method"))
        root, name, note = choose_run_folder(self.subcommand, name, given, ckpt and str(ckpt), RUN_ROOT)
        if note and self.subcommand:
            print(note, file=sys.stderr, flush=True)
        remember_folder(root)
        cfg.trainer.default_root_dir = str(root)
        self.run_name = name
        self._fill_loggers(cfg, name, str(root))
        for cb in (cfg.get("callbacks") or {}).values():
            if cb is not None and cb.class_path.endswith("ModelCheckpoint") and cb.init_args.get("dirpath") is None:
                cb.init_args.dirpath = str(Path(root) / "checkpoints")
                cb.init_args.enable_version_counter = False  # last.ckpt is the newest run's, never last-v1.ckpt

    @staticmethod
    def _fill_loggers(cfg: Namespace, name: str, root: str) -> None:
        for lg in _logger_specs(cfg):
            a = lg.init_args
            if "save_dir" in a and a.get("save_dir") in (None, "."):
                a.save_dir = root
            if "WandbLogger" in lg.class_path:
                a.name = a.get("name") or name
                if "group" in a and a.get("group") is None:
                    a.group = cfg.get("name")
                if cfg.get("method"):
                    a.tags = list(dict.fromkeys([*(a.get("tags") or []), cfg.method]))

    def _parse_ckpt_path(self) -> None:
        """Checks ``--ckpt_path`` (`intact_checkpoint`) before LightningCLI loads it for its hyper-parameters (a
        damaged file would end there in a torch traceback)."""
        sub = self.config.get("subcommand")
        cfg = self.config[sub] if sub else None
        ckpt = cfg.get("ckpt_path") if cfg is not None else None
        if ckpt and ckpt not in ("last", "best", "hpc", "registry"):
            run = run_name(cfg.get("name"), cfg.get("method"))
            cfg.ckpt_path = intact_checkpoint(
                str(ckpt), use_intact=bool(cfg.get("resume_intact")), run=run, run_root=RUN_ROOT
            )
        ckpt = self.config[sub].get("ckpt_path") if sub else None
        if not ckpt or not Path(ckpt).is_file():
            return
        # memory-mapped, read once: the hyperparameters and the loop state, not a multi-GB state dict
        state = torch.load(ckpt, weights_only=True, map_location="cpu", mmap=True)
        self._apply_ckpt_hparams(sub, ckpt, dict(state.get("hyper_parameters") or {}))
        if sub == "fit":
            _say_if_finished(ckpt, state, self.config[sub].get("trainer"))

    def _apply_ckpt_hparams(self, sub: str, ckpt: str, hparams: dict[str, Any]) -> None:
        """As LightningCLI's ``_parse_ckpt_path``: the checkpoint's hyperparameters override the config's (a resume
        trains what was trained), given as the module's ``init_args`` (`cli.flat_flags.checkpoint_init_args`: a
        checkpoint of an earlier version's arguments resumes too)."""
        hparams.pop("_instantiator", None)
        class_path = hparams.pop("_class_path", None)
        if not hparams or class_path is None:
            return
        hparams = checkpoint_init_args(class_path, hparams)
        try:
            self.config = self.parser.parse_object(
                {sub: {"model": {"class_path": class_path, "init_args": hparams}}}, self.config
            )
        except SystemExit:
            sys.stderr.write(f"--ckpt_path {ckpt}: its hyperparameters do not parse with this version's module\n")
            raise

    def instantiate_trainer(self, **kwargs: Any) -> L.Trainer:
        config = {**self._get(self.config_init, "trainer", default={}), **kwargs}
        extra = [self._get(self.config_init, c) for c in self._parser(self.subcommand).callback_keys]
        named = [cb for cb in (self._get(self.config_init, "callbacks") or {}).values() if cb is not None]
        if config.get("enable_progress_bar") is False:  # Lightning refuses a progress bar it was told not to show
            named = [cb for cb in named if not isinstance(cb, ProgressBar)]
        # a callback given in trainer.callbacks replaces the named one of the same class (docs/decisions.md)
        listed = config.get("callbacks") or []
        listed_types = {type(cb) for cb in (listed if isinstance(listed, list) else [listed])}
        named = [cb for cb in named if type(cb) not in listed_types]
        trainer = self._instantiate_trainer(config, extra + named)
        trainer.run_name = getattr(self, "run_name", None)
        checkpoint_temps(trainer, clean=self.subcommand == "fit")
        trainer.callbacks.insert(0, CheckpointDisk())  # the checkpoints' size against the free disk, before step 1
        trainer.callbacks.insert(0, RunEnd())  # first: Ctrl-C's checkpoint exists before the others record it
        return trainer

    def _run_subcommand(self, subcommand: str) -> None:
        """The subcommand, then the lines the run ends with (the results, the run folder, the checkpoint, and after a
        Ctrl-C the resume command), after what the loggers print at their end (W&B's summary)."""
        if subcommand == "export":
            return super()._run_subcommand(subcommand)
        argv = list(sys.argv[1:] if self._args is None else self._args)
        try:
            super()._run_subcommand(subcommand)
        except torch.OutOfMemoryError as e:
            raise OutOfMemory(oom_line(self._sub(), subcommand)) from e
        except SystemExit:  # Lightning exits with 1 after a Ctrl-C (its on_exception hooks have run)
            if any(isinstance(cb, RunEnd) and cb.interrupted for cb in self.trainer.callbacks):
                print_end(self.trainer, argv, interrupted=True)
                raise SystemExit(EXIT_CODES["interrupted"]) from None  # not 1, which the scheme keeps for a bug
            raise
        print_end(self.trainer, argv)


def _say_if_finished(ckpt: str, state: dict[str, Any], trainer: Any) -> None:
    """One line on stderr when ``ckpt``'s run (its loaded ``state``) has reached the trainer's ``max_steps`` /
    ``max_epochs`` (a resume that trains nothing would otherwise end with no word)."""
    line = finished_run_line(ckpt, {k: state.get(k) for k in ("epoch", "global_step", "loops")}, trainer)
    if line and rank_zero_only.rank == 0:
        print(f"note: {line}", file=sys.stderr, flush=True)


def _logger_specs(cfg: Namespace) -> list[Namespace]:
    loggers = cfg.trainer.get("logger")
    specs = loggers if isinstance(loggers, list) else [loggers]
    return [lg for lg in specs if isinstance(lg, Namespace) and "init_args" in lg and "class_path" in lg]


def cli_main(args: list[str] | None = None, run: bool = True) -> LightningCLI:
    return SynGRPOCLI(args=args, run=run)


def error_class(e: BaseException) -> str | None:
    """``config``, ``data``, ``model`` or ``memory`` for the errors a user makes (their message says what to fix), else
    None."""
    msg = str(e)
    if isinstance(e, ConfigError):
        return "config"
    if isinstance(e, OutOfMemory):  # its one line names the card, the measured peak and the settings that lower it
        return "memory"
    if isinstance(e, DataError):  # a defect in a data file, named with its file and line
        return "data"
    if isinstance(e, JudgeUnavailable):  # judge.on_failure: raise; its one line names the endpoint and the fix
        return "model"
    hub = type(e).__module__.startswith("huggingface_hub")
    if hub or (isinstance(e, OSError) and "model_name_or_path" in msg):
        return "model"
    if isinstance(e, ValueError | FileNotFoundError) and "--" in msg:
        return "config"
    return None


def main(args: list[str] | None = None) -> None:
    """The command line. A user's error (a flag or config, a data file, a model that cannot be loaded) prints one line
    ``error: ...`` and exits with its class's status (`cli.errors.EXIT_CODES`); anything else keeps its traceback.
    ``--debug`` (or ``SYN_GRPO_DEBUG=1``) shows the traceback of every error."""
    from_argv = args is None
    args = list(sys.argv[1:] if from_argv else args)
    debug = "--debug" in args or bool(os.environ.get("SYN_GRPO_DEBUG") or os.environ.get("SYN_GRPO_TRACEBACK"))
    args = [a for a in args if a != "--debug"]
    if from_argv:  # LightningCLI reads sys.argv itself (and warns when given both)
        sys.argv[1:], args = args, None
    try:
        cli_main(args)
    except Exception as e:
        kind = error_class(e)
        if debug or kind is None:
            raise
        fail(" ".join(_user_message(e).split()) + " (--debug shows the traceback)", EXIT_CODES[kind])


def _user_message(e: BaseException) -> str:
    """The message that says what to fix: the innermost cause that names a flag (``--model.sampling.group_size must
    be >= 2 ...``) rather than the parser's wrapper around it (``Does not validate against any of the Union
    subtypes ... Given value: Namespace(...)``), or a flag's line inside that wrapper; else ``e``'s own."""
    seen, cause = set(), e
    best = None
    while cause is not None and id(cause) not in seen:
        seen.add(id(cause))
        if str(cause).startswith("--"):
            best = str(cause)
        cause = cause.__cause__ or cause.__context__
    if best is not None:
        return best
    m = re.search(r"(?m)^\s*-\s*(--\S+ .*)$", str(e))
    return m.group(1) if m else str(e)


if __name__ == "__main__":
    main(sys.argv[1:])
