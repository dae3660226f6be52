"""All that is left of ``GRPOModule``'s flat arguments of before the typed groups (issue 39; docs/interfaces.md,
"Migrating a config"), in this one module: the rest of the code calls into it and knows nothing of the old names.

* `MOVED`: where each flat argument lives now (``kl_coef`` -> ``kl.coef``, ``diversity_beta`` ->
  ``method.init_args.diversity_beta``), the one table everything below reads.
* `moved_hint`: the words an unknown flag's error adds when the flag is an old one (``it moved to --model.kl.coef``).
* `checkpoint_init_args`: a checkpoint's hyperparameters as the module's ``init_args`` in the groups, so that a
  checkpoint saved before the groups still resumes and evaluates (``--ckpt_path``).
* `flat_hparams`: a module's hyperparameters under the flat names too, which the export's model card and
  ``generation_config.json`` read for GRPOModule and SFTModule alike.
* `migrate_text` and `main`: ``python -m cli.migrate_config`` (its entry point), which rewrites a config file:

    python -m cli.migrate_config configs/my_run.yaml [more.yaml ...]       # rewrites the files in place
    python -m cli.migrate_config --check configs/my_run.yaml               # lists what would move, exit 1 if any

  Only the ``model:`` block's ``init_args`` change; comments and the order of the other keys stay. Each key of `MOVED`
  moves into its group (``kl_coef`` -> ``kl: {coef}``); ``method: <name>`` and ``method_args`` become ``method:
  {class_path, init_args}`` with the method's keys (``diversity_beta``, reward weights, ...) in its ``init_args``. A
  method key the chosen method does not take (``diversity_beta`` on ``cycle_grpo``) is dropped, and said so.
  `migrate_flag` does the same for one ``--model.<key>`` option.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path
from typing import Any

import yaml

from lightning_modules.methods.base import METHODS

__all__ = [
    "MOVED",
    "checkpoint_init_args",
    "flat_hparams",
    "main",
    "migrate_flag",
    "migrate_init_args",
    "migrate_text",
    "moved_hint",
]

MOVED: dict[str, str] = {
    **{k: f"policy.{k}" for k in ("model_name_or_path", "dtype", "attn_implementation", "local_files_only")},
    **{k: f"policy.{k}" for k in ("gradient_checkpointing", "freeze_vision")},
    **{k: f"sampling.{k}" for k in ("prompt_template", "group_size", "temperature", "top_p", "max_new_tokens")},
    "min_new_tokens": "sampling.min_new_tokens",
    "rollout_engine": "engines.rollout_engine",
    "update_engine": "engines.update_engine",
    "rollout_compile": "engines.rollout_compile",
    "rollout_engine_args": "engines.rollout_args",
    "rollout_gather": "engines.rollout_gather",
    **{k: f"engines.{k}" for k in ("micro_batch_size", "ref_micro_batch_size", "vision_checkpointing")},
    "kl_coef": "kl.coef",
    "kl_estimator": "kl.estimator",
    "reference_offload": "kl.reference_offload",
    **{
        k: f"optimisation.{k}"
        for k in (
            "num_iterations",
            "clip_low",
            "clip_high",
            "dual_clip",
            "aggregation",
            "advantage_scale",
            "advantage_eps",
            "entropy_coef",
            "entropy_adv_coef",
            "entropy_adv_kappa",
            "master_weights",
            "max_grad_norm",
        )
    },
    "eval_prompt_template": "evaluation.prompt_template",
    "eval_format": "evaluation.format",
    **{
        k: f"method.init_args.{k}"
        for k in (
            "accuracy_weight",
            "accuracy_threshold",
            "format",
            "format_weight",
            "diversity_weight",
            "diversity_reward_form",
            "diversity_beta",
            "description_selection",
        )
    },
    "seed": "method.init_args.selection_seed",
    "method_args": "method.init_args",
}
"""Where each argument of the flat ``GRPOModule`` signature (before the groups) lives now."""


_KEY = re.compile(r"^(\s*)([A-Za-z_][A-Za-z0-9_]*):(.*)$")
SFT_ONLY = {"build_tiny", "target", "export_dir", "eval_max_new_tokens", "warmup_ratio", "cosine_decay", "caption_frac"}
"""Keys only `SFTModule` takes: a block with one of them is an SFT config, whose ``policy`` keys alone move."""


def method_class_path(name: str) -> str:
    """The class path of registered method ``name`` (``grpo`` -> ``lightning_modules.methods.grpo.GRPO``)."""
    cls = METHODS[name]
    return f"{cls.__module__}.{cls.__qualname__}"


def _method_keys(class_path: str | None) -> set[str] | None:
    """The arguments the registered method at ``class_path`` takes (None: not a registered one)."""
    name = next((n for n in METHODS if method_class_path(n) == class_path), None)
    return set(METHODS[name].argument_defaults()) if name else None


def migrate_flag(flag: str) -> str:
    """One ``--model[.init_args].<old>[=value]`` option (or a sweep's ``model.init_args.<old>`` key) in the new
    spelling; anything else unchanged."""
    m = re.match(r"^(-*model\.(?:init_args\.)?)([a-z_]+)((?:\.[A-Za-z0-9_.]+)?)(=.*)?$", flag)
    if not m or m.group(2) not in MOVED:
        return flag
    prefix, key, rest, value = m.group(1), m.group(2), m.group(3), m.group(4) or ""
    return f"{prefix}{MOVED[key]}{rest}{value}"


def moved_hint(flag: str) -> str:
    """`` (it moved to <new flag>: ...)`` for a flat ``GRPOModule`` flag of before the typed groups
    (``--model.kl_coef`` -> ``--model.kl.coef``), which an unknown flag's one-line error adds; else ``""``."""
    new = migrate_flag(flag)
    if new == flag:
        return ""
    return (
        f" (it moved to {new}: GRPOModule's settings are in typed groups; `python -m cli.migrate_config FILE` "
        "rewrites a config)"
    )


def migrate_init_args(init: dict[str, Any], sft: bool = False) -> dict[str, Any]:
    """A ``GRPOModule`` ``init_args`` mapping (a config's, a checkpoint's hyperparameters) in the typed groups: the
    mapping form of `migrate_text`. Keys the method does not take are dropped; a mapping already in groups is returned
    as it is. ``sft``: an `SFTModule`'s, whose policy keys alone move."""
    if sft:
        out = {k: v for k, v in init.items() if not MOVED.get(k, "").startswith("policy.")}
        moved = {MOVED[k].split(".")[1]: v for k, v in init.items() if MOVED.get(k, "").startswith("policy.")}
        if moved:
            out["policy"] = {**(init.get("policy") or {}), **moved}
        return out
    if not any(k in MOVED for k in init):
        return dict(init)
    out: dict[str, Any] = {}
    name = init.get("method")
    method: dict[str, Any] = {"class_path": method_class_path(name) if name in METHODS else name} if name else {}
    args: dict[str, Any] = dict(init.get("method_args") or {})
    for key, value in init.items():
        if key in ("method", "method_args"):
            continue
        if key not in MOVED:
            out[key] = value
        elif MOVED[key].startswith("method."):
            args[MOVED[key].split(".")[-1]] = value
        else:
            group, sub = MOVED[key].split(".")
            out.setdefault(group, {})[sub] = value if not (sub == "rollout_args" and value is None) else {}
    class_path = method.get("class_path") or method_class_path("syn_grpo")
    accepted = _method_keys(class_path)
    out["method"] = {
        "class_path": class_path,
        "init_args": {k: v for k, v in args.items() if accepted is None or k in accepted},
    }
    return out


def checkpoint_init_args(class_path: str, hparams: dict[str, Any]) -> dict[str, Any]:
    """The hyperparameters of a checkpoint of the module at ``class_path`` as that module's ``init_args`` in the
    typed groups: a checkpoint of the flat arguments is translated (`migrate_init_args`), any other returned as is."""
    return migrate_init_args(hparams, sft=class_path.endswith("SFTModule"))


def flat_hparams(hparams: Any) -> dict[str, Any]:
    """A module's hyperparameters with every grouped setting also under its flat name (``kl.coef`` as ``kl_coef``,
    ``method.init_args.diversity_beta`` as ``diversity_beta``, the method's class path as ``method``), for the export,
    whose model card and generation config serve GRPOModule and SFTModule alike; other keys pass through."""
    hp = dict(hparams)
    out = dict(hp)
    for old, new in MOVED.items():
        node: Any = hp
        for part in new.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if node is not None and old != "method_args":
            out[old] = node
    method = hp.get("method")
    if isinstance(method, dict) and "class_path" in method:
        out["method"] = method["class_path"]
    return out


def _items(lines: list[str], start: int, indent: int) -> tuple[list[tuple[str | None, list[str]]], int]:
    """The items of the mapping whose keys sit at ``indent`` from line ``start``: (key, its lines), comment and blank
    lines joining the next item; returns them and the index of the first line after the mapping."""
    items: list[tuple[str | None, list[str]]] = []
    pending: list[str] = []
    i = start
    while i < len(lines):
        line = lines[i]
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            pending.append(line)
            i += 1
            continue
        lead = len(line) - len(line.lstrip())
        if lead < indent:
            break
        if lead == indent:
            m = _KEY.match(line)
            items.append((m.group(2) if m else None, [*pending, line]))
            pending = []
        else:
            items[-1][1].extend([*pending, line])
            pending = []
        i += 1
    if pending:  # trailing comments / blanks belong after the mapping
        i -= len(pending)
    return items, i


def _value(item_lines: list[str], indent: int) -> Any:
    text = "\n".join(ln[indent:] if len(ln) >= indent else ln.lstrip() for ln in item_lines)
    return next(iter(yaml.safe_load(text).values()))


def _comment(line: str) -> str:
    m = re.search(r"\s(#.*)$", line)
    return f"  {m.group(1)}" if m else ""


def _indent(item_lines: list[str], by: int) -> list[str]:
    return [(" " * by + ln) if ln.strip() else ln for ln in item_lines]


def _rename(item_lines: list[str], old: str, new: str) -> list[str]:
    out, done = [], False
    for ln in item_lines:
        if not done and re.match(rf"^\s*{old}:", ln):
            ln = ln.replace(f"{old}:", f"{new}:", 1)
            done = True
        out.append(ln)
    return out


def migrate_text(text: str, where: str = "<config>") -> tuple[str, list[str]]:
    """``text`` (a YAML config) with its ``model.init_args`` in the typed groups, and notes on what moved."""
    lines = text.splitlines()
    notes: list[str] = []
    try:
        top = lines.index("model:")
    except ValueError:
        return text, notes
    model_items, _ = _items(lines, top + 1, 2)
    init = next((k for k, _ in model_items if k == "init_args"), None)
    if init is None:
        return text, notes
    # where init_args starts and its items
    start = next(i for i in range(top + 1, len(lines)) if re.match(r"^  init_args:\s*(#.*)?$", lines[i]))
    items, end = _items(lines, start + 1, 4)
    keys = {k for k, _ in items}
    sft = "SFTModule" in text or bool(keys & SFT_ONLY)
    moved = {k: v for k, v in MOVED.items() if v.startswith("policy.")} if sft else MOVED
    if not any(k in moved or (k == "method" and not sft) for k in keys):
        return text, notes
    class_path = None
    method_comment = ""
    method_args: dict[str, Any] = {}
    method_comments: dict[str, str] = {}
    method_notes: list[str] = []
    groups: dict[str, list[str]] = {}
    out: list[str] = []
    placed: set[str] = set()
    method_at = None
    for key, item in items:
        if key not in moved and key != "method" or sft and key == "method":
            out.extend(item)
            continue
        if key == "method":
            value = _value(item, 4)
            if isinstance(value, str):
                class_path = method_class_path(value) if value in METHODS else value
                method_comment = _comment(item[-1])
            else:  # already a mapping
                out.extend(item)
                continue
        elif key == "method_args":
            method_args.update(_value(item, 4) or {})
            method_notes += [m.group(1) for ln in item if (m := re.search(r"(?:^|\s)(#.*)$", ln))]
        elif key in MOVED and MOVED[key].startswith("method."):
            sub = MOVED[key].split(".")[-1]
            method_args[sub] = _value(item, 4)
            method_comments[sub] = _comment(item[-1])
        elif key in MOVED:
            group, sub = MOVED[key].split(".")
            if group not in placed:
                placed.add(group)
                out.append(f"\0{group}")
            groups.setdefault(group, []).extend(_indent(_rename(item, key, sub), 2))
            continue
        else:
            out.extend(item)
            continue
        if method_at is None:
            method_at = len(out)
            out.append("\0method")
    accepted = (
        None if sft else _method_keys(class_path or (method_class_path("syn_grpo") if "class_path:" in text else None))
    )
    if accepted is not None:
        for k in sorted(set(method_args) - accepted):
            notes.append(f"{where}: dropped {k}: {method_args.pop(k)!r} (the method {class_path} takes no {k})")
    body: list[str] = []
    if class_path is None and "class_path: lightning_modules.grpo.GRPOModule" in text and not sft:
        class_path = method_class_path("syn_grpo")  # the default, named
    if class_path is not None or method_args:
        body.append("    method:" + method_comment)
        if class_path is not None:
            body.append(f"      class_path: {class_path}")
        if method_args:
            body.append("      init_args:")
            body += [f"        {k}: {_flow(v)}{method_comments.get(k, '')}" for k, v in method_args.items()]
        body += [f"      {c}" for c in method_notes]
    new: list[str] = []
    for ln in out:
        if ln == "\0method":
            new.extend(body)
        elif ln.startswith("\0"):
            group = ln[1:]
            new.append(f"    {group}:")
            new.extend(groups[group])
        else:
            new.append(ln)
    for k in items:
        if k[0] in moved and k[0] != "method_args":
            notes.append(f"{where}: {k[0]} -> {moved[k[0]]}")
    result = [*lines[: start + 1], *new, *lines[end:]]
    return "\n".join(result) + ("\n" if text.endswith("\n") else ""), notes


def _flow(v: Any) -> str:
    return yaml.safe_dump(v, default_flow_style=True, width=10_000).strip().removesuffix("\n...").removesuffix("...")


MIGRATE = "Rewrite a config (or a command line) written for the flat ``GRPOModule`` arguments into the typed groups."


def main(argv: list[str] | None = None) -> int:
    """``python -m cli.migrate_config [--check] FILE ...`` (module docstring); returns the exit status."""
    ap = argparse.ArgumentParser(prog="python -m cli.migrate_config", description=MIGRATE)
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--check", action="store_true", help="only list what would move; exit 1 if anything would")
    args = ap.parse_args(argv)
    changed = 0
    for path in args.files:
        text = path.read_text()
        new, notes = migrate_text(text, str(path))
        if new != text:
            changed += 1
            if not args.check:
                path.write_text(new)
        for n in notes:
            print(n)
    print(f"{changed} of {len(args.files)} file(s) {'would change' if args.check else 'rewritten'}")
    return 1 if args.check and changed else 0
