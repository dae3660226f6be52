"""FSDP2 at one rank through ``train.py fit``: a run killed after its distributed checkpoint and resumed from it, against
the same run uninterrupted (issue 57, item 3: the 7B recipe's strategy on the one GPU a machine here has).

    python bench/fsdp_resume.py --arch 3b --out experiments/results/fsdp_resume_h100.json   # GPU machine (one call)
    python bench/fsdp_resume.py --smoke                                                     # CPU: configs/tiny.yaml, gloo

Three runs of ``python train.py fit --config <file>``, each a subprocess running exactly the user's command. The file is
the config composed as ``train.py`` composes it (``bench/e2e_gpu.py``'s `compose`), with what ``e2e_gpu`` overrides
(paths and lengths: `swap_paths_and_lengths`, synthesis off) and then, all listed in the output's ``overridden``:
``--trainer.strategy fsdp2`` on one device with what the strategy's checks demand (``precision 32-true``: the fp32
shards are the masters; no compiled decode step; the ``hf`` update engine, rec_7b.yaml's, for ``packed``, which runs
the model's sub-modules past FSDP2's root unit), ``max_steps`` N + 1 with one epoch longer than that and no
validation, the loggers off (``metrics.jsonl``, a callback, is what is compared; a killed run's W&B service would
outlive it), the checkpoint callback's interval N, and the batch: ``--batch``, or on an 80 GB card `H100_BATCH`
prompts and update micro-batches of `H100_MICRO_BATCH` rows (the output's ``builds.batch`` says which).

(a) **uninterrupted**: N + 1 steps, saving nothing;
(b) **killed**: the same run saving ``last.ckpt`` every N steps (``save_top_k 0``, ``save_last true``: one checkpoint
    on disk) and going on. Once the distributed checkpoint of step N is complete (its ``checksums.json``, the last file
    a save writes, is in place: core/checkpoint_files.py) and the run has logged step N + 1 from the state it saved,
    the process group gets SIGKILL, as a crash would (its ``max_steps`` is N + 2, so it is still running then; from
    N = 3, the default, those N + 2 steps hold one save: at N = 2 step 4 would be a second, and the checkpoint-disk
    check counts two checkpoints on disk at once, `killed_run_files`);
(c) **resumed**: ``--ckpt_path <run>/checkpoints/last.ckpt`` in (b)'s run folder (a resume continues its own run,
    docs/outputs.md), which runs step N + 1 again. (a) and (c) save nothing (``save_last false``), so one full
    checkpoint is on disk at a time (3B: 43.1 GiB of fp32 shards and AdamW moments): the run folders go under
    ``--work`` when its disk holds that, else under /dev/shm (`runs_root`; a 64 GiB disk holds the image, the model
    and little more).

Compared: every per-step ``train/*`` metric of step N + 1 but time and memory, the loss among them (``pg_loss +
kl.coef * kl``: the token-mean loss the step minimised, from its two logged parts): (c) against (b)'s own step N + 1,
the verdict; (c) against (a), reported; and (b)'s steps 1..N against (a)'s, the floor (two runs that share everything
but the save).

**Expected: (c) = (b) at step N + 1, bit for bit.** The checkpoint holds the fp32 master shards, the AdamW moments and
step count, the CPU and CUDA RNG states (``GRPOModule.on_save_checkpoint``: the rollouts sample from them) and the
train loader's position (datamodules/resumable.py: the order is a function of the seed and the epoch); so step N + 1
of (c) starts from the bits (b) held in memory when it saved, and its rollout and forwards run the same kernels on
them. A difference there is a resume bug. Where a kernel is not deterministic for the same inputs (a GPU backward that
adds with atomics: cuDNN attention's, torch warns), the floor shows it, and then the step's gradient (``grad_norm``,
the one metric after a backward) is judged against bf16's tolerance, ``|c - b| <= 2**-7 * max(|b|, |c|)`` (bf16's
machine epsilon), while every other metric must still be equal bit for bit. (c) against (a) is exact on a deterministic
machine (the CPU); on a GPU it is not a test of the resume: Adam divides each gradient element by its own scale, so the
atomics' last-bit noise in step 1's gradient becomes a different update, and (a) and (b) part after one step (one H100,
2026-12-07: step 2's KL 0.2 % apart, its gradient norm 1.8 %, before any save: experiments/results/fsdp_resume_h100_b8.json).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
import yaml  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

from bench.e2e_gpu import (  # noqa: E402
    build_qwen,
    compose,
    export_toy,
    machine,
    read_jsonl,
    step_times,
    swap_paths_and_lengths,
)
from callbacks.checkpoint_disk import files_at_peak  # noqa: E402
from core.checkpoint_files import MANIFEST, damage  # noqa: E402

BF16_EPS = 2.0**-7
"""bf16's machine epsilon: the tolerance of step N + 1's gradient norm where the floor shows a nondeterministic backward."""
NOT_COMPARED = ("train/time/", "train/peak_mem_gib")
"""Per-step metrics that measure the machine, not the step's numbers."""
AFTER_BACKWARD = ("train/grad_norm",)
"""Per-step metrics read after the step's backward: the only ones a nondeterministic backward kernel can move within the
step (its rollout, rewards, log-probs, KL and loss come from forwards)."""
CARD_GIB_FOR_PAPER_BATCH = 100
"""Below this much GPU memory (an 80 GB card) the 3B run takes ``--batch``'s H100 default, not the paper's 20."""
H100_BATCH = 8
"""Prompts per step on an 80 GB card: FSDP2 at one rank keeps the fp32 masters, fp32 gradients and AdamW moments
(16 B per parameter, ~56 GiB at 3.75B) on the GPU, and the rollout gathers a bf16 copy (~7 GiB)."""
H100_MICRO_BATCH = 1
"""Rows per update micro-batch on an 80 GB card (with gradient checkpointing and the reference's shards in host
memory: `fsdp_sets`): at 2 rows one H100 ran out of memory with the reference on the GPU (peak 77.8 GiB); at 1 the run
peaked at 71.0 GiB (2026-12-07, experiments/results/fsdp_resume_h100_b8.json); the gradient is the same sum."""
CHECKPOINT_BYTES_PER_PARAM = 12
"""One FSDP2 checkpoint per parameter: the fp32 shard (the master) and AdamW's two fp32 moments."""
SHM = Path("/dev/shm")
"""Memory-backed: where the run folders go when the work folder's disk cannot hold one checkpoint."""


# ------------------------------------------------------------------------------------------------------------ configs
Sets = list[tuple[str, Any]]
"""Overrides of a composed config: (dotted key, value)."""


def fsdp_sets(args: argparse.Namespace, cfg: dict[str, Any], batch: int | None, cuda: bool, small_card: bool) -> Sets:
    """The overrides the three runs share, applied after the paths and lengths (``--set`` last)."""
    n = args.steps
    sets: Sets = [
        ("trainer.strategy", "fsdp2"),
        ("trainer.devices", 1),
        ("trainer.precision", "32-true"),
        ("trainer.max_steps", n + 1),
        ("trainer.limit_val_batches", 0),
        ("callbacks.checkpoint.init_args.every_n_train_steps", n),
        ("callbacks.checkpoint.init_args.save_top_k", 0),
    ]
    if not cuda and cfg["trainer"].get("accelerator") != "cpu":
        sets.append(("trainer.accelerator", "cpu"))  # the GPU mode's code paths on a machine without one (tiny arch)
    engines = cfg["model"]["init_args"].get("engines", {})
    if engines.get("rollout_compile"):
        sets.append(("model.init_args.engines.rollout_compile", False))  # the FSDP2 check: recompiled every step
    if engines.get("update_engine") == "packed":  # the FSDP2 check: it runs sub-modules past the root unit
        sets.append(("model.init_args.engines.update_engine", "hf"))  # as rec_7b.yaml, the FSDP2 recipe
    if batch is not None:
        sets.append(("data.init_args.batch_size", batch))
    if small_card and engines.get("micro_batch_size", 0) > H100_MICRO_BATCH:
        sets.append(("model.init_args.engines.micro_batch_size", H100_MICRO_BATCH))
    if small_card:  # one H100, 2026-12-07: out of memory at micro-batches of 2 (peak 77.2 GiB), and with gradient
        # checkpointing still (77.8 GiB): 60 GiB of fp32 state + the bf16 reference + the rollout's gathered bf16 copy
        # leave too little; rec_7b.yaml checkpoints too, and the reference's shards go to host memory
        if not cfg["model"]["init_args"].get("policy", {}).get("gradient_checkpointing"):
            sets.append(("model.init_args.policy.gradient_checkpointing", True))
        sets.append(("model.init_args.kl.reference_offload", True))
    for item in args.set:  # KEY=VALUE, the value in YAML (as e2e_gpu's --set)
        key, _, value = item.partition("=")
        sets.append((key, yaml.safe_load(value)))
    return sets


def override(cfg: dict[str, Any], sets: Sets) -> list[str]:
    """Apply ``sets`` in place; returns ``key: old -> new`` for each value changed."""
    changed = []
    for key, new in sets:
        *parents, leaf = key.split(".")
        node = cfg
        for k in parents:
            node = node.setdefault(k, {})
        if node.get(leaf) != new:
            changed.append(f"{key}: {_short(node.get(leaf))} -> {_short(new)}")
        node[leaf] = new
    return changed


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def run_config(
    base: dict[str, Any], ctx: dict[str, Any], run_dir: Path, sets: Sets, *, save: bool
) -> tuple[dict[str, Any], list[str]]:
    """One run's config and what was overridden: the paths (``--smoke``: the run folder, the toy world's folder, the
    checkpoint folder; else `swap_paths_and_lengths`, e2e_gpu's paths and lengths), synthesis off, no logger, then
    ``sets`` and whether the checkpoint callback saves ``last.ckpt``."""
    cfg = json.loads(json.dumps(base))
    if ctx["smoke"]:
        changed = override(
            cfg,
            [
                ("trainer.default_root_dir", str(run_dir)),
                ("data.init_args.data_root", str(Path(ctx["work"]) / "toy")),
                ("callbacks.checkpoint.init_args.dirpath", str(run_dir / "checkpoints")),
                ("callbacks.synthesis.init_args.mode", "off"),
            ],
        )
    else:
        changed = swap_paths_and_lengths(cfg, ctx=ctx, run_dir=run_dir, synthesis="off")
    loggers = cfg["trainer"].get("logger")
    if loggers:  # metrics.jsonl (a callback) is what is compared; a killed run's W&B service would outlive the kill
        changed.append(f"trainer.logger: {len(loggers) if isinstance(loggers, list) else 1} logger(s) -> False")
        cfg["trainer"]["logger"] = False
    changed += override(cfg, [*sets, ("callbacks.checkpoint.init_args.save_last", save)])
    return cfg, changed


# ------------------------------------------------------------------------------------------------------------ runs
def launch(cfg: dict[str, Any], work: Path, name: str, *extra: str) -> tuple[subprocess.Popen, list[str]]:
    """``python train.py fit --config <work>/configs/<name>.yaml [extra]`` in its own process group, logging to
    ``<work>/logs/<name>.log``."""
    path = work / "configs" / f"{name}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd = [sys.executable, "train.py", "fit", "--config", str(path), *extra]
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    log = work / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    return proc, cmd


def finish(proc: subprocess.Popen, timeout: float) -> int:
    """The exit status of ``proc`` (124 after ``timeout`` s, its process group killed)."""
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        return 124


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL to ``proc``'s process group (the trainer, its data-loader workers, anything it started), then reap."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def kill_after_checkpoint(
    proc: subprocess.Popen, ckpt: Path, timeout: float, metrics: Path | None = None, step: int | None = None
) -> dict[str, Any]:
    """Wait until ``ckpt`` is complete (its `MANIFEST` in place) and, with ``metrics``, until that file holds the
    ``train`` row of ``step``; then SIGKILL the run's process group."""
    t0, marker = time.time(), ckpt / MANIFEST
    seen = None
    while seen is None or (metrics is not None and step not in train_rows(read_jsonl(metrics))):
        if seen is None and marker.exists():
            seen = time.time()
        if proc.poll() is not None:
            what = "its checkpoint was complete" if seen is None else f"it logged step {step}"
            return {"killed": False, "rc": proc.returncode, "why": f"the run ended before {what}"}
        if time.time() - t0 > timeout:
            kill_group(proc)
            what = f"a complete checkpoint at {ckpt}" if seen is None else f"step {step}'s row in {metrics}"
            return {"killed": False, "rc": 124, "why": f"no {what} within {timeout:.0f} s"}
        time.sleep(0.02)
    row_seen = time.time()
    kill_group(proc)
    reaped = time.time() - row_seen
    time.sleep(0.5)  # what the group started (loader workers) gets the same SIGKILL; the kernel needs a moment
    return {
        "killed": proc.returncode == -signal.SIGKILL,
        "rc": proc.returncode,
        "checkpoint_complete_at": seen,
        "checkpoint_complete_after_s": round(seen - t0, 1),
        "killed_after_checkpoint_s": round(row_seen - seen, 1),
        "killed_and_reaped_in_s": round(reaped, 3),
        "group_left_running": group_alive(proc.pid),
    }


def checkpoint_facts(ckpt: Path) -> dict[str, Any]:
    """What the killed run left: the step its checkpoint holds, the files (shards, ``meta.pt``, manifest) and their
    size, and the structural check a resume makes (the bytes' checksums are the resume's own check)."""
    files = sorted(p for p in ckpt.iterdir() if p.is_file()) if ckpt.is_dir() else []
    facts: dict[str, Any] = {"path": str(ckpt), "files": [p.name for p in files]}
    facts["gib"] = round(sum(p.stat().st_size for p in files) / 2**30, 2)
    facts["damage"] = damage(ckpt, contents=False)
    if facts["damage"] is None:
        meta = torch.load(ckpt / "meta.pt", map_location="cpu", weights_only=False)
        facts["global_step"] = meta["global_step"]
        facts["rng_states_saved"] = "rng_states" in meta
    return facts


def segments(rows: list[dict[str, Any]]) -> list[list[dict[str, Any]]]:
    """``metrics.jsonl`` split at each ``start`` line: one list per process that wrote to it (the start row first)."""
    out: list[list[dict[str, Any]]] = []
    for r in rows:
        if r.get("event") == "start":
            out.append([r])
        elif out:
            out[-1].append(r)
    return out


def train_rows(segment: list[dict[str, Any]]) -> dict[int, dict[str, Any]]:
    return {r["step"]: r for r in segment if r.get("event") == "train"}


# ------------------------------------------------------------------------------------------------------------ compare
def step_metrics(row: dict[str, Any], kl_coef: float) -> dict[str, float]:
    """The row's per-step numbers (`NOT_COMPARED` apart), with the step's loss rebuilt from its logged parts."""
    out = {k: v for k, v in row.items() if k.startswith("train/") and not k.startswith(NOT_COMPARED)}
    if isinstance(out.get("train/pg_loss"), float) and isinstance(out.get("train/kl"), float):
        out["loss"] = out["train/pg_loss"] + kl_coef * out["train/kl"]
    return out


def compare(a: dict[str, Any], b: dict[str, Any], kl_coef: float) -> dict[str, Any]:
    """Metric by metric: both values, the difference, and whether it is inside bf16's tolerance (`BF16_EPS`)."""
    ma, mb = step_metrics(a, kl_coef), step_metrics(b, kl_coef)
    rows, within = {}, True
    for k in sorted(set(ma) | set(mb)):
        x, y = ma.get(k), mb.get(k)
        if isinstance(x, int | float) and isinstance(y, int | float):
            diff = abs(y - x)
            ok = diff <= BF16_EPS * max(abs(x), abs(y))
        else:
            diff, ok = None, x == y  # a null (a non-finite value) or a metric one side lacks
        within &= ok
        rows[k] = {"expected": x, "compared": y, "abs_diff": diff, "within_bf16": ok}
    exact = all(ma.get(k) == mb.get(k) for k in rows)
    forward = all(ma.get(k) == mb.get(k) for k in rows if k not in AFTER_BACKWARD)
    return {"exact": exact, "forward_exact": forward, "within_bf16": within, "metrics": rows}


def verdict(resumed: dict[str, Any] | None, floor: list[dict[str, Any]], step: int) -> tuple[bool, str]:
    """(passed, the one line) for (c) against (b)'s own step ``step``: every metric equal bit for bit; or, where the
    floor shows nondeterministic kernels, every metric but the gradient's (`AFTER_BACKWARD`) equal bit for bit and the
    gradient's within bf16's tolerance."""
    if resumed is None:
        return False, f"FAIL: no step {step} to compare (a run failed: see the runs' rc and log tails)"
    floor_exact = all(f["exact"] for f in floor)
    loss = resumed["metrics"].get("loss", {})
    what = f"step {step} loss {loss.get('compared')!r} resumed vs {loss.get('expected')!r} before the kill"
    if resumed["exact"]:
        before = "equal too" if floor_exact else "not bit-equal (nondeterministic kernels)"
        return (
            True,
            f"PASS: {what}, every per-step metric equal bit for bit (steps 1..{step - 1} of two runs: {before})",
        )
    worst = _worst(resumed["metrics"])
    if floor_exact:
        return False, f"FAIL: {what}; not equal although two runs before the kill were (a resume bug): worst {worst}"
    if resumed["forward_exact"] and resumed["within_bf16"]:
        return True, (
            f"PASS (the gradient within bf16's tolerance 2**-7 relative, every other metric bit for bit): {what}; "
            f"the backward is nondeterministic here (steps 1..{step - 1} of two runs differ): worst {worst}"
        )
    return False, f"FAIL: {what}; a metric before the backward differs, or the gradient beyond 2**-7: worst {worst}"


def _worst(metrics: dict[str, dict[str, Any]]) -> str:
    """The metric furthest from its expected value, relative to its size."""
    rel = {
        k: v["abs_diff"] / max(abs(v["expected"]), abs(v["compared"]), 1e-30)
        for k, v in metrics.items()
        if v["abs_diff"]
    }
    if not rel:
        return "a metric one run lacks or logged as null"
    k = max(rel, key=rel.get)
    return f"{k} {metrics[k]['compared']!r} vs {metrics[k]['expected']!r} (relative {rel[k]:.2e})"


def run_summary(rc: int, cmd: list[str], launched: float, segment: list[dict[str, Any]], log: Path) -> dict[str, Any]:
    """One run's figures from its own ``metrics.jsonl`` segment (and its log's tail when it failed)."""
    train = [r for r in segment if r.get("event") == "train"]
    start = segment[0] if segment else {}
    r: dict[str, Any] = {
        "command": "python " + " ".join(cmd[1:]),
        "rc": rc,
        "process_wall_s": round(time.time() - launched, 1),
        "resumed": bool(start.get("resumed")),
        "start_step": start.get("step"),
        "trained_steps": [x["step"] for x in train],
        **step_times(segment),
    }
    if start.get("time"):
        r["startup_s"] = round(start["time"] - launched, 1)  # imports, model load and sharding, a resume's restore
    peaks = [x["train/peak_mem_gib"] for x in train if x.get("train/peak_mem_gib") is not None]
    if peaks:
        r["peak_mem_gib"] = round(max(peaks), 2)
    text = log.read_text(errors="replace") if log.exists() else ""
    disk = [line for line in text.splitlines() if line.startswith("checkpoints: one full checkpoint")]
    if disk:
        r["checkpoint_disk_line"] = disk[0]  # callbacks/checkpoint_disk.py: the size of one save, the free disk
    if rc != 0:
        r["log_tail"] = text[-3000:]
    return r


def prepare(args: argparse.Namespace, work: Path) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any], Sets]:
    """(the composed config, the paths' context, the builds and batch, the runs' shared overrides) for the mode asked."""
    config = (
        Path(args.config) if args.config else REPO / "configs" / ("tiny.yaml" if args.smoke else "rec_3b_1gpu.yaml")
    )
    base = compose([config])
    cuda = torch.cuda.is_available() and not args.smoke
    small_card = cuda and torch.cuda.get_device_properties(0).total_memory / 2**30 < CARD_GIB_FOR_PAPER_BATCH
    batch = args.batch if args.batch is not None else H100_BATCH if small_card else None
    prompts = batch or base["data"]["init_args"]["batch_size"]
    builds: dict[str, Any] = {"config": str(config.relative_to(REPO)) if config.is_relative_to(REPO) else str(config)}
    ctx: dict[str, Any] = {"work": str(work), "smoke": args.smoke}
    if args.smoke:  # the config's own toy checkpoint and toy world
        model_dir = Path(base["model"]["init_args"]["policy"]["model_name_or_path"])
    else:  # e2e_gpu's random-weight model and toy REC rows at 448 px under the config's file names
        builds["qwen"] = build_qwen(work / f"qwen-{args.arch}", args.arch, "cuda" if cuda else "cpu", vocab_size=4096)
        model_dir = Path(builds["qwen"]["path"])
        train_samples = prompts * (args.steps + 3)  # one epoch outlasts the runs: no epoch boundary inside them
        ctx.update(
            arch=args.arch,
            epochs=1,
            model_dir=str(model_dir),
            train_samples=train_samples,
            val_samples=2,
            toy={"rec": export_toy(work, "rec", max(train_samples, 32), 2, 448)},
        )
    builds["params"] = saved_params(model_dir if model_dir.is_absolute() else REPO / model_dir)
    builds["batch"] = {
        "prompts": prompts,
        "group_size": base["model"]["init_args"]["sampling"]["group_size"],
        "config_prompts": base["data"]["init_args"]["batch_size"],
        "source": batch_source(args.batch, batch),
    }
    return base, ctx, builds, fsdp_sets(args, base, batch, cuda, small_card)


def batch_source(asked: int | None, batch: int | None) -> str:
    if batch is None:
        return "the config"
    if asked is not None:
        return "--batch"
    return (
        f"an 80 GB card (under {CARD_GIB_FOR_PAPER_BATCH} GiB): {H100_BATCH} prompts, update micro-batches of "
        f"{H100_MICRO_BATCH} rows"
    )


def saved_params(model_dir: Path) -> int:
    """Parameters of a saved model folder, from its safetensors headers (nothing is loaded)."""
    from safetensors import safe_open

    n = 0
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(f, "pt") as fh:
            n += sum(math.prod(fh.get_slice(k).get_shape()) for k in fh.keys())
    return n


def free_bytes(folder: Path) -> int:
    """Free bytes of the filesystem that holds (or will hold) ``folder``."""
    p = folder
    while not p.exists() and p != p.parent:
        p = p.parent
    return shutil.disk_usage(p).free


def killed_run_files(n: int) -> int:
    """Full checkpoints on disk at once in the killed run (``save_top_k 0``, ``last.ckpt`` every N steps, ``max_steps``
    N + 2, a new folder), counted by the checkpoint-disk check itself (`files_at_peak`): one from N = 3, two below (a
    second save is written beside the first)."""
    cb = ModelCheckpoint(save_top_k=0, every_n_train_steps=n, save_last=True)
    steps = SimpleNamespace(estimated_stepping_batches=n + 2, max_epochs=None)  # what files_at_peak reads of a trainer
    return files_at_peak(cb, steps, fresh=True)[0]


def runs_root(args: argparse.Namespace, work: Path, params: int) -> tuple[Path | None, str]:
    """Where the run folders go: ``--runs-dir``, else ``<work>/runs`` when its disk holds one checkpoint
    (`CHECKPOINT_BYTES_PER_PARAM`) with 10 % to spare, else `SHM`'s when it does; ``None`` when neither does. With the
    reason, in words."""
    files = killed_run_files(args.steps)
    need = files * CHECKPOINT_BYTES_PER_PARAM * params
    what = "one checkpoint" if files == 1 else f"--steps {args.steps}: two checkpoints at once (--steps 3 saves once)"
    if args.runs_dir:
        return Path(args.runs_dir), "--runs-dir"
    free = {}
    for root in (work / "runs", SHM / "fsdp_resume_runs"):
        free[root] = free_bytes(root) if root.parent.exists() else 0
        if free[root] >= 1.1 * need:
            return root, f"{what} ~{need / 2**30:.1f} GiB; {free[root] / 2**30:.1f} GiB free there"
    where = ", ".join(f"{r.parent} {f / 2**30:.1f} GiB" for r, f in free.items())
    return None, f"{what} needs ~{need / 2**30:.1f} GiB and no folder has it free ({where}): pass --runs-dir"


PLAN = {"uninterrupted": ("uninterrupted", False), "killed": ("killed", True), "resumed": ("killed", False)}
"""Run: (its folder under the runs root, whether it saves ``last.ckpt``). The resume continues the killed run's folder;
the runs go in this order."""


def run_all(args: argparse.Namespace, work: Path, root: Path, base: dict, ctx: dict, sets: Sets, save: Saver) -> dict:
    """The three runs (`PLAN`), each one's figures added to the result as it ends (``save()`` writes the result)."""
    result = save.result
    runs: dict[str, dict[str, Any]] = result.setdefault("runs", {})
    ckpt = root / "killed" / "checkpoints" / "last.ckpt"
    for name, (folder, saves) in PLAN.items():
        run_dir = root / folder
        if name == "resumed" and runs["killed"].get("checkpoint", {}).get("global_step") != args.steps:
            runs[name] = {"skipped": f"the killed run left no complete checkpoint of step {args.steps}"}
            continue
        if name != "resumed":
            shutil.rmtree(run_dir, ignore_errors=True)
        cfg, changed = run_config(base, ctx, run_dir, sets, save=saves)
        result.setdefault("overridden", changed)
        if name == "killed":  # still running when step N + 1 is logged (GRPO's schedule does not read max_steps)
            cfg["trainer"]["max_steps"] = args.steps + 2
            result["killed_run_max_steps"] = args.steps + 2
        launched = time.time()
        proc, cmd = launch(cfg, work, name, *(["--ckpt_path", str(ckpt)] if name == "resumed" else []))
        kill = (
            kill_after_checkpoint(proc, ckpt, args.timeout, run_dir / "metrics.jsonl", args.steps + 1)
            if name == "killed"
            else None
        )
        rc = proc.returncode if kill is not None else finish(proc, args.timeout)
        segs = segments(read_jsonl(run_dir / "metrics.jsonl"))
        seg = segs[-1] if segs else []
        runs[name] = run_summary(rc, cmd, launched, seg, work / "logs" / f"{name}.log")
        if kill is not None:
            runs[name].update(kill, wrote_end=any(r.get("event") == "end" for r in seg))
            runs[name]["checkpoint"] = checkpoint_facts(ckpt)
            step_n = train_rows(seg).get(args.steps)
            if step_n and kill.get("checkpoint_complete_at"):  # step N's row is written just before the save starts
                runs[name]["checkpoint"]["save_s"] = round(kill["checkpoint_complete_at"] - step_n["time"], 1)
        print(f"[{name}] rc={rc} steps {runs[name]['trained_steps']} ({runs[name]['process_wall_s']} s)", flush=True)
        save()
    if not args.keep_checkpoint:
        shutil.rmtree(ckpt, ignore_errors=True)  # 3B: ~42 GiB, in memory when under /dev/shm
    return runs


def judge(result: dict[str, Any], root: Path, n: int, kl_coef: float) -> None:
    """The comparisons and the verdict, into ``result``."""
    a = _train_rows(root / "uninterrupted" / "metrics.jsonl", 0)
    b, c = _train_rows(root / "killed" / "metrics.jsonl", 0), _train_rows(root / "killed" / "metrics.jsonl", 1)
    result["floor"] = [dict(compare(a[s], b[s], kl_coef), step=s) for s in range(1, n + 1) if s in a and s in b]
    resumed = compare(b[n + 1], c[n + 1], kl_coef) if n + 1 in b and n + 1 in c else None
    result["resumed_vs_killed"] = dict(resumed, step=n + 1) if resumed else None
    vs_a = compare(a[n + 1], c[n + 1], kl_coef) if n + 1 in a and n + 1 in c else None
    result["resumed_vs_uninterrupted"] = dict(vs_a, step=n + 1) if vs_a else None
    passed, line = verdict(resumed, result["floor"], n + 1)
    if vs_a is not None:
        line += f"; against the uninterrupted run: {'equal bit for bit' if vs_a['exact'] else 'not equal'}"
    failed = [
        f"{k} rc={r['rc']}: {_last_line(r)}" for k, r in result["runs"].items() if r.get("rc") not in (0, -9, None)
    ]
    if failed:
        line += "; " + "; ".join(failed)
    killed = result["runs"]["killed"]
    if not (killed.get("killed") and not killed.get("wrote_end") and not killed.get("group_left_running")):
        passed, line = False, f"FAIL: the run was not killed as a crash would be: {_short(killed)}"
    peaks = [r["peak_mem_gib"] for r in result["runs"].values() if "peak_mem_gib" in r]
    starts = [result["runs"][k].get("startup_s") for k in ("uninterrupted", "resumed")]
    if None not in starts:  # the resume's integrity check (every byte read) and restore, over a fresh start's
        result["resume_overhead_s"] = round(starts[1] - starts[0], 1)
    result.update(
        passed=passed,
        verdict=line,
        s_per_step=result["runs"]["uninterrupted"].get("median_step_s"),
        peak_mem_gib=max(peaks) if peaks else None,
    )


def _last_line(run: dict[str, Any]) -> str:
    """The last line a failed run printed (an out-of-memory error is one line that names what lowers the peak)."""
    lines = [x for x in run.get("log_tail", "").splitlines() if x.strip()]
    return lines[-1][:300] if lines else "no output"


def _train_rows(path: Path, segment: int) -> dict[int, dict[str, Any]]:
    """The ``train`` rows by step of the ``segment``-th process that wrote ``path`` (0: the first)."""
    segs = segments(read_jsonl(path))
    return train_rows(segs[segment]) if len(segs) > segment else {}


class Saver:
    """Writes ``result`` to ``--out`` (when given) each time it is called: a call cut short keeps what it measured."""

    def __init__(self, out: str | None, result: dict[str, Any]) -> None:
        self.out, self.result = Path(out) if out else None, result

    def __call__(self) -> None:
        if self.out is not None:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            self.out.write_text(json.dumps(self.result, indent=1, default=str) + "\n")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="CPU: configs/tiny.yaml with its toy checkpoint, gloo")
    ap.add_argument("--arch", default="3b", choices=("3b", "7b", "tiny"), help="e2e_gpu's random Qwen2.5-VL")
    ap.add_argument("--config", default=None, help="default configs/rec_3b_1gpu.yaml (configs/tiny.yaml with --smoke)")
    ap.add_argument(
        "--steps",
        type=int,
        default=3,
        help="N: a checkpoint every N steps, the kill after step N + 1's (>= 3: one save)",
    )
    ap.add_argument("--batch", type=int, default=None, help=f"prompts per step (default: the config's; {H100_BATCH} "
                    f"on a card under {CARD_GIB_FOR_PAPER_BATCH} GiB)")  # fmt: skip
    ap.add_argument("--set", action="append", default=[], help="KEY=VALUE on every run's composed config; repeatable")
    ap.add_argument("--work", default="/tmp/fsdp_resume", help="the random model, the data, logs")
    ap.add_argument("--runs-dir", default=None, help="the run folders (default: runs_root's choice)")
    ap.add_argument("--keep-checkpoint", action="store_true", help="keep the killed run's checkpoint at the end")
    ap.add_argument("--timeout", type=float, default=420, help="seconds per fit run")
    ap.add_argument("--out", default=None, help="results JSON (written after each run)")
    args = ap.parse_args(argv)
    if args.steps < 1:
        ap.error("--steps must be >= 1")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    base, ctx, builds, sets = prepare(args, work)
    root, why = runs_root(args, work, builds["params"])
    result: dict[str, Any] = {
        "bench": __doc__.split("\n\n")[0],
        "command": "python bench/fsdp_resume.py " + " ".join(sys.argv[1:] if argv is None else argv),
        **machine(),
        "steps_before_kill": args.steps,
        "builds": builds,
        "runs_dir": {"path": str(root) if root else None, "why": why},
        "prepare_s": round(time.time() - t0, 1),
    }
    save = Saver(args.out, result)
    if root is None:
        result.update(passed=False, verdict=f"FAIL before any run: {why}")
    else:
        run_all(args, work, root, base, ctx, sets, save)
        judge(result, root, args.steps, float(base["model"]["init_args"].get("kl", {}).get("coef", 0.0)))
    result["total_s"] = round(time.time() - t0, 1)
    save()
    print(result["verdict"], flush=True)
    return result


if __name__ == "__main__":
    sys.exit(0 if main()["passed"] else 1)
