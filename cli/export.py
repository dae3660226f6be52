"""``train.py export``: a trained policy as a Hugging Face model directory.

The directory holds what ``from_pretrained`` needs (weights, config, processor / tokenizer, chat template), a
``generation_config.json`` with the run's evaluation decoding (greedy, its ``max_new_tokens``), ``prompt_template.json``
(the instruction the policy was trained under, per task, and the answer format) and a ``README.md`` model card.
The frozen reference model is never built (``GRPOModule.inference_only``); the checkpoint is memory-mapped.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

from cli.errors import ConfigError
from cli.flat_flags import flat_hparams
from core.prompts import PROMPT_TEMPLATES


def _policy_state(
    ckpt_path: str | Path, model: L.LightningModule, weights_only: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(the ``policy.*`` tensors, a few facts) of a Lightning checkpoint, memory-mapped; a distributed checkpoint (a
    folder of shards, ``--trainer.strategy fsdp2``) is read into ``model``'s own tensors."""
    if Path(ckpt_path).is_dir():
        return _sharded_policy_state(Path(ckpt_path), model)
    ckpt = torch.load(str(ckpt_path), map_location="cpu", mmap=True, weights_only=weights_only)
    state = ckpt.get("state_dict") or {}
    policy = {k: v for k, v in state.items() if k.startswith("policy.")}
    if not policy:
        raise ConfigError(
            f"--ckpt_path {ckpt_path}: the checkpoint holds no policy weights (no 'policy.*' in its state_dict); "
            "pass a checkpoint written by a GRPOModule / SFTModule fit"
        )
    facts = {"global_step": ckpt.get("global_step"), "epoch": ckpt.get("epoch")}
    return policy, facts


def _sharded_policy_state(path: Path, model: L.LightningModule) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The full policy of a distributed checkpoint (``ModelParallelStrategy``: ``.metadata``, one ``.distcp`` file
    per rank, ``meta.pt``), read in this one process: each tensor's shards are copied into ``model``'s tensor of the
    same name (the fp32 masters cast to the export's ``--model.policy.dtype``); the optimizer state is never read."""
    import torch.distributed.checkpoint as dcp

    if not (path / "meta.pt").is_file() or not (path / ".metadata").is_file():
        raise ConfigError(
            f"--ckpt_path {path}: a folder but not a distributed checkpoint (no meta.pt / .metadata); pass a "
            "checkpoint file, or a checkpoint folder written by a --trainer.strategy fsdp2 run"
        )
    saved = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    policy = {k: v for k, v in model.state_dict().items() if k.startswith("policy.")}
    missing = [k for k in policy if f"state_dict.{k}" not in saved]
    if missing:
        raise ConfigError(
            f"--ckpt_path {path}: {len(missing)} policy weights missing (e.g. {missing[0]}); the checkpoint is of "
            "another model than --model.init_args.policy.model_name_or_path"
        )
    dcp.load({"state_dict": policy}, checkpoint_id=str(path), no_dist=True)
    meta = torch.load(str(path / "meta.pt"), map_location="cpu", weights_only=False)
    return policy, {"global_step": meta.get("global_step"), "epoch": meta.get("epoch")}


EXPORT_MARKER = ".train-py-export"
"""The file that marks a folder as written by ``train.py export`` (and its to rewrite)."""


def check_out(out: Path) -> None:
    """An export writes only into a new or empty folder or one an export wrote (its marker, or the
    ``prompt_template.json`` only an export writes): never over a model or files of one's own."""
    if not out.is_dir() or (out / EXPORT_MARKER).is_file() or (out / "prompt_template.json").is_file():
        return
    theirs = sorted(p.name for p in out.iterdir())
    if theirs:
        shown = ", ".join(theirs[:3]) + (f" and {len(theirs) - 3} more" if len(theirs) > 3 else "")
        raise ConfigError(
            f"--out {out}: holds files no export wrote ({shown}), which an export would overwrite; pass a new or "
            "empty folder"
        )


def export_policy(
    model: L.LightningModule,
    ckpt_path: str | Path | None,
    out: str | Path,
    run_name: str | None = None,
    weights_only: bool = False,
) -> Path:
    """Load the policy of ``model`` (from its ``model_name_or_path``) with the weights of ``ckpt_path`` and write
    it, with its processor, to ``out``; returns ``out``."""
    if not hasattr(model, "policy"):
        raise ConfigError(f"export needs a module with a policy (GRPOModule, SFTModule), got {type(model).__name__}")
    check_out(Path(out))  # before the weights load: a refused folder costs nothing
    model.inference_only = True
    model.configure_model()
    facts: dict[str, Any] = {}
    if ckpt_path:
        state, facts = _policy_state(ckpt_path, model, weights_only)
        result = model.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if k.startswith("policy.")]
        if missing:
            raise ConfigError(
                f"--ckpt_path {ckpt_path}: {len(missing)} policy weights missing (e.g. {missing[0]}); the checkpoint "
                "is of another model than the config's model_name_or_path"
            )
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / EXPORT_MARKER).write_text("Written by train.py export, which rewrites this folder.\n")
    model.policy.save_pretrained(out)
    model.processor.save_pretrained(out)
    hp = flat_hparams(model.hparams)
    _write_generation_config(model, out, hp)
    _write_prompt_template(out, hp)
    _write_card(out, hp, ckpt_path, facts, run_name)
    _make_readable(out)
    return out


def _make_readable(out: Path) -> None:
    """Give every exported file the mode an ordinary file gets (0644 under the usual umask): safetensors writes its
    shards 0600, which a teammate or a serving process under another user cannot read."""
    umask = os.umask(0)
    os.umask(umask)
    for f in out.rglob("*"):
        if f.is_file() and not f.is_symlink():
            f.chmod(0o666 & ~umask)


def _write_generation_config(model: L.LightningModule, out: Path, hp: dict[str, Any]) -> None:
    gen = model.policy.generation_config
    gen.do_sample = False  # the evaluation protocol (Acc@0.5, mAP) decodes greedily
    for key in ("temperature", "top_p", "top_k"):
        setattr(gen, key, None)
    max_new = hp.get("max_new_tokens") or hp.get("eval_max_new_tokens")
    if max_new:
        gen.max_new_tokens = int(max_new)
    gen.save_pretrained(out)


def _template_names(hp: dict[str, Any]) -> list[str]:
    t = hp.get("prompt_template", "syn_grpo")
    return list(t) if isinstance(t, list | tuple) else [t]


def _write_prompt_template(out: Path, hp: dict[str, Any]) -> None:
    names = _template_names(hp)
    (out / "prompt_template.json").write_text(
        json.dumps(
            {
                "name": names[0],
                "templates": {n: PROMPT_TEMPLATES[n] for n in names if n in PROMPT_TEMPLATES},
                "format": hp.get("format", "syn_grpo"),
                "task": hp.get("task", "rec"),
                "usage": "the user turn is the image then templates[name][task].format(query=...)",
            },
            indent=2,
        )
        + "\n",
        encoding="utf-8",
    )


def _write_card(out: Path, hp: dict[str, Any], ckpt: Any, facts: dict[str, Any], run_name: str | None) -> None:
    keep = (
        "model_name_or_path",
        "task",
        "method",
        "prompt_template",
        "format",
        "group_size",
        "kl_coef",
        "diversity_weight",
        "diversity_beta",
        "description_selection",
        "target",
    )
    rows = "\n".join(f"| {k} | {hp[k]} |" for k in keep if k in hp)
    card = f"""---
library_name: transformers
pipeline_tag: image-text-to-text
tags: [syn-grpo, grpo, qwen2.5-vl, grounding]
---

# {run_name or out.name}

Exported with `python train.py export` on {time.strftime("%Y-%m-%d")} from `{ckpt or hp.get("model_name_or_path")}`
(optimizer step {facts.get("global_step")}, epoch {facts.get("epoch")}).

| setting | value |
| --- | --- |
{rows}

Decoding for evaluation is greedy (`generation_config.json`); the instruction the policy was trained under is in
`prompt_template.json`. Load it like any Qwen2.5-VL checkpoint:

```python
from transformers import AutoModelForImageTextToText, AutoProcessor
model = AutoModelForImageTextToText.from_pretrained("{out}")
processor = AutoProcessor.from_pretrained("{out}")
```

or evaluate it with the project: `python train.py test --config <config> --model.init_args.policy.model_name_or_path {out}`.
"""
    (out / "README.md").write_text(card, encoding="utf-8")
