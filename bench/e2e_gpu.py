"""End-to-end GPU harness: the paper's configs through ``train.py fit``, on random-weight real architectures.

Nothing here re-assembles the GRPO step: every figure of a ``fit`` run is read from what ``python train.py fit``
wrote (``metrics.jsonl``, the CSV log, the data server's output folder). On the GPU machine (no network, no weights):

    python bench/e2e_gpu.py --runs rec_3b_1gpu:off --trl --parity --out experiments/results/e2e_gpu_h200.json
    python bench/e2e_gpu.py --runs rec_3b_1gpu:async,rec_3b_1gpu:sync,ovd_3b_1gpu:async --out ...
    python bench/e2e_gpu.py --server 640,1024 --out ...          # the SDXL data server alone, through its HTTP API
    python bench/e2e_gpu.py --arch qwen3vl-4b --runs cycle_4b:off --out ...   # Qwen3-VL-4B (CycleGRPO, hf engines)
    python bench/e2e_gpu.py --smoke                                # CPU: the same code paths, tiny architectures

What a call does, in order:
1. **Builds** local checkpoints from the real configs, random weights, saved with ``save_pretrained`` (no call needs to
   carry them): Qwen2.5-VL-3B (``bench/grpo_step.py``'s written-out config.json) with a Qwen2.5-VL processor around a
   byte-level BPE tokenizer trained here on the project's prompts (so prompts tokenize to about as many tokens as
   with Qwen's tokenizer) — or Qwen3-VL-4B (``--arch qwen3vl-4b``: its published dimensions, ``QWEN3_VL``, around the
   same tokenizer) — and SDXL base + ControlNet-Union (``synth/random_sdxl.py``) as a diffusers directory.
   Toy-world scenes at 448 x 448 are exported as VLM-R1 JSONL under the file names each config reads, and toy video
   clips (16 frames at 2 fps, ``--video-size`` px) as video JSONL for the video configs (``cycle_st_7b``).
2. **Runs** ``train.py fit`` on each config of ``--runs`` (``config[+overlay...]:synthesis``). The config is composed
   exactly as ``train.py fit --config A --config B`` composes it, then **only paths and lengths** are overridden (the
   list is written into the results): model / data / image paths and the data server's model paths; the train set
   (``--train-samples``, 3 steps per epoch at 20 prompts), 2 epochs (so one swap happens), one validation batch; the
   synthesis mode (``off`` / ``async`` / ``sync``); checkpoints go to the run folder. Random weights write no
   parsable description, so with synthesis on the offline-descriptions path (the "offline generation" baseline's
   source) drives jobs to the SDXL server; Syn-GRPO's own description selection is exercised on the CPU with the toy
   model (tests/cli/test_config_runs.py, ``make train``).
3. Reads **s/step** (median of steps 2..n, steps that span an epoch boundary left out: those hold validation and the
   swap), peak memory (``train/peak_mem_gib``, the training process's own allocator), epoch wall time, images
   synthesized (files in the run's ``synth/``), swaps and audit failures (the callback's ``synth/*`` log), and the
   server's images/s while training (output files over their time span). A paper epoch (2,000 samples / 20 = 100
   steps) is longer than one 10-minute call: its time is **extrapolated** from the measured steps, and says so.
4. ``--trl``: TRL's ``GRPOTrainer`` (use_vllm=False) on the same work (20 prompts x 6, one 448 x 448 image and the
   same number of prompt text tokens per prompt, 256 new tokens) at the same precision policy (fp32 master weights:
   fp32 parameters under bf16 autocast), in the same call: its median step after the first.
5. ``--parity``: the fast rollout engine and the packed update engine against the HF path on the real 3B
   architecture, on fixed (teacher-forced) completions: log-prob differences next to the bf16-vs-fp32 noise, the loss,
   and the gradient cosine similarity.
6. ``--server``: the data server alone (``python -m synth.server`` via ``LocalServer``), jobs through ``SynthClient``
   over HTTP (queue, paint, paste-back, audit): images/s at each long side given.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import io
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

PAPER_EPOCH_STEPS = 100  # 2,000 samples / 20 prompts


# ------------------------------------------------------------------------------------------------------------ build
def _corpus() -> list[str]:
    """The project's prompts and answer formats: the text a REC / OVD run tokenizes."""
    from core.prompts import PROMPT_TEMPLATES
    from datamodules.toy import generate_split

    lines = []
    for templates in PROMPT_TEMPLATES.values():
        for t in templates.values():
            lines.append(t.format(query="the small red circle"))
    for rec in generate_split("train", 200, seed=1, size=224):
        lines.append(rec["conversations"][0]["value"].replace("<image>", ""))
    lines += [
        "<think>The query asks for the small red circle on the left.</think><diversity>0.42</diversity>"
        "<description>a striped blue background with many small green triangles</description>"
        "<answer>[112, 40, 296, 220]</answer>",
        "system\nYou are a helpful assistant. user assistant",
    ] * 20
    return lines * 5


def build_qwen(out: Path, arch: str, device: str, vocab_size: int) -> dict[str, Any]:
    """A random-weight Qwen2.5-VL of ``arch`` (``3b`` / ``7b`` / ``tiny``) with a processor, via ``save_pretrained``."""
    import torch

    from bench.grpo_step import build_config, use_tokenizer_ids
    from lightning_modules.models.tiny_model import build_processor, train_bpe_tokenizer

    t0 = time.perf_counter()
    if (out / "config.json").exists():
        return {"path": str(out), "reused": True}
    tok = train_bpe_tokenizer(_corpus(), vocab_size=vocab_size)
    processor = build_processor(tok, image_size=448)
    if arch in QWEN3_VL:
        return build_qwen3_vl(out, arch, processor, device, t0)
    cfg = build_config(arch)
    use_tokenizer_ids(cfg, tok)
    cfg.text_config.eos_token_id = tok.convert_tokens_to_ids("<|im_end|>")
    cfg.text_config.bos_token_id = tok.convert_tokens_to_ids("<|endoftext|>")
    from transformers import Qwen2_5_VLForConditionalGeneration

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2_5_VLForConditionalGeneration._from_config(cfg, attn_implementation="sdpa", dtype=dtype)
    model.generation_config.eos_token_id = cfg.text_config.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out)
    processor.save_pretrained(out)
    n = sum(p.numel() for p in model.parameters())
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"path": str(out), "arch": arch, "params": n, "tokenizer_len": len(tok), "build_s": time.perf_counter() - t0}


# Qwen3-VL-4B-Instruct's published dimensions (its config.json), built with random weights: no download.
QWEN3_VL = {
    "qwen3vl-4b": dict(
        hidden_size=2560,
        layers=36,
        heads=32,
        kv_heads=8,
        head_dim=128,
        intermediate_size=9728,
        mrope_section=[24, 20, 20],
        rope_theta=5_000_000.0,
        vision_hidden_size=1024,
        vision_intermediate_size=4096,
        vision_depth=24,
        vision_heads=16,
        deepstack_visual_indexes=(5, 11, 17),
        num_position_embeddings=2304,
        image_size=448,
    ),
    "qwen3vl-tiny": {},  # --smoke: the tiny builder's defaults (the tests' Qwen3-VL)
}


def build_qwen3_vl(out: Path, arch: str, processor, device: str, t0: float) -> dict[str, Any]:
    """A random-weight Qwen3-VL of ``arch`` (``QWEN3_VL``) with the stand-in tokenizer of ``processor``."""
    import torch

    from lightning_modules.models.tiny_model import build_tiny_qwen3_vl

    tok_dir = out.parent / f"{out.name}-tokenizer"
    processor.save_pretrained(tok_dir)
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    build_tiny_qwen3_vl(out, tok_dir, device=device, dtype=dtype, **QWEN3_VL[arch])
    n = _saved_param_count(out)
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"path": str(out), "arch": arch, "params": n, "build_s": time.perf_counter() - t0}


def _saved_param_count(path: Path) -> int:
    """Parameters of a saved model directory, read from its safetensors headers (nothing is loaded)."""
    import math

    from safetensors import safe_open

    n = 0
    for f in sorted(path.glob("*.safetensors")):
        with safe_open(f, "pt") as fh:
            n += sum(math.prod(fh.get_slice(k).get_shape()) for k in fh.keys())
    return n


def build_sdxl(out: Path, size: str, device: str) -> dict[str, Any]:
    """Random-weight SDXL base + ControlNet-Union ProMax saved as a diffusers pipeline directory."""
    import torch
    from diffusers import StableDiffusionXLControlNetUnionInpaintPipeline

    from synth.random_sdxl import build_random_sdxl_components

    t0 = time.perf_counter()
    if (out / "model_index.json").exists():
        return {"path": str(out), "reused": True}
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    comps = build_random_sdxl_components(size, union=True, device=device, dtype=dtype)
    pipe = StableDiffusionXLControlNetUnionInpaintPipeline(**comps)
    pipe.save_pretrained(out)
    del pipe, comps
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return {"path": str(out), "size": size, "build_s": time.perf_counter() - t0}


def build_sam2(out: Path, size: str) -> dict[str, Any]:
    """A random-weight SAM 2 folder (``synth.random_sam2``; ``large``: sam2.1-hiera-large's architecture)."""
    from synth.random_sam2 import save_random_sam2

    t0 = time.perf_counter()
    if (out / "config.json").exists():
        return {"path": str(out), "reused": True}
    save_random_sam2(out, size)
    return {"path": str(out), "size": size, "build_s": round(time.perf_counter() - t0, 1)}


def build_mask_data(work: Path, size: str, device: str, n: int = 64) -> dict[str, str]:
    """For a config on the released RL parquet: a random-weight VQ-SAM2 of ``size`` (``hiera-l``: the release's
    SAM 2.1 Hiera-L) in the release's layout (``mask_tokenizer_256x2.pth`` beside a transformers ``sam2/``), and ``n``
    toy scenes in the parquet's schema, their masks encoded by it (``export_toy_parquet``); built once per ``work``."""
    from bench.mask_decode import build_net, save_released
    from datamodules.cycle_seg import export_toy_parquet
    from lightning_modules.models.mask_tokenizer.vq_sam2 import VQSam2MaskTokenizer

    root = work / f"cycle_parquet_{size}"
    out = {"tokenizer": str(root / "vq-sam2"), "parquet": str(root / "train_rl.parquet"), "root": str(root)}
    if (root / "train_rl.parquet").exists():
        return out
    net = build_net(size)
    save_released(net, root / "vq-sam2")
    export_toy_parquet(root / "train_rl.parquet", VQSam2MaskTokenizer(net, device=device), n=n, size=448)
    return out


def export_toy(root: Path, task: str, n_train: int, n_val: int, size: int) -> Path:
    from datamodules.toy import export_jsonl, export_offline_descriptions

    d = root / f"toy_{task}_{size}"
    export_jsonl(d, "train", n_train, seed=0, task=task, size=size)
    export_jsonl(d, "val", n_val, seed=0, task=task, size=size)
    export_offline_descriptions(d, "train", task=task)
    return d


def export_toy_video(root: Path, n_train: int, n_val: int, size: int) -> Path:
    """The toy video world (16 frames at 2 fps) as video JSONL, for the configs that read it (``cycle_st_7b``)."""
    from datamodules.toy_video import export_jsonl

    d = root / f"toy_video_{size}"
    export_jsonl(d, "train", n_train, seed=0, size=size)
    export_jsonl(d, "val", n_val, seed=0, size=size)
    return d


# ------------------------------------------------------------------------------------------------------------ config
def compose(paths: list[Path]) -> dict[str, Any]:
    """The config exactly as ``train.py fit --config A --config B ...`` composes it (``--print_config``)."""
    import yaml

    from train import cli_main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), contextlib.suppress(SystemExit):
        cli_main(["fit", *[a for p in paths for a in ("--config", str(p))], "--print_config"])
    return yaml.safe_load(buf.getvalue())


def swap_paths_and_lengths(cfg: dict[str, Any], *, ctx: dict[str, Any], run_dir: Path, synthesis: str) -> list[str]:
    """Override only paths and lengths (and the synthesis mode, and what ``--set`` names), in place; returns what was
    overridden."""
    import yaml

    from datamodules import toy_video
    from datamodules.toy import jsonl_path

    changed: list[str] = []

    def put(d: dict, key: str, value: Any, where: str) -> None:
        if d.get(key) != value:
            changed.append(f"{where}.{key}: {d.get(key)!r} -> {value!r}")
        d[key] = value

    t, m, d = cfg["trainer"], cfg["model"]["init_args"], cfg["data"]["init_args"]
    task = m.get("task", "rec")
    pol, smp = m.setdefault("policy", {}), m.setdefault("sampling", {})  # GRPOModule's typed groups
    put(pol, "model_name_or_path", ctx["model_dir"], "model.policy")
    if cfg["data"]["class_path"].endswith("VideoGroundingDataModule"):  # video configs read the toy video world
        task = "video"
        jsonl_path = lambda root, split, task: toy_video.jsonl_path(root, split)  # noqa: E731
    toy = ctx["toy"][task]
    data = run_dir / "data"
    data.mkdir(parents=True, exist_ok=True)
    for name in d.get("train_files") or []:
        shutil.copy(jsonl_path(toy, "train", task), data / name)
    for files in (d.get("val_files") or {}, d.get("test_files") or {}):
        for name in files.values():
            shutil.copy(jsonl_path(toy, "val", task), data / name)
    if d.get("parquet_files"):  # CycleGRPO on the released parquet (overlays/cycle_4b_parquet.yaml)
        masks = build_mask_data(Path(ctx["work"]), "tiny" if ctx.get("smoke") else "hiera-l", ctx["device"])
        put(d, "parquet_files", [masks["parquet"]], "data")
        put(d, "parquet_image_root", masks["root"], "data")
        put(m["method"].setdefault("init_args", {}), "mask_tokenizer", masks["tokenizer"], "model.method")
    put(d, "data_root", str(data), "data")
    put(d, "image_root", str(toy), "data")
    put(d, "max_train_samples", ctx["train_samples"], "data")
    put(d, "max_eval_samples", ctx["val_samples"], "data")
    # random weights rarely sample EOS: fix every completion at the config's length (the same work as TRL's run)
    put(smp, "min_new_tokens", smp.get("max_new_tokens", 256) if not ctx.get("smoke") else 16, "model.sampling")
    put(t, "max_epochs", ctx["epochs"], "trainer")
    put(t, "limit_val_batches", 1, "trainer")
    put(t, "default_root_dir", str(run_dir), "trainer")
    if ctx.get("smoke"):
        put(t, "accelerator", "cpu", "trainer")
        put(smp, "max_new_tokens", 16, "model.sampling")
    loggers = t.get("logger") or []
    if isinstance(loggers, list) and importlib.util.find_spec("wandb") is None:
        # a machine without wandb (20 MB of wheels to carry): the run keeps its other loggers and metrics.jsonl
        kept = [lg for lg in loggers if not str(lg.get("class_path", "")).endswith("WandbLogger")]
        if len(kept) != len(loggers):
            changed.append(f"trainer.logger: W&B logger dropped (wandb is not installed here), kept {len(kept)}")
            t["logger"] = loggers = kept or False
    for lg in loggers or []:
        if isinstance(lg, dict) and "save_dir" in lg.get("init_args", {}):
            put(lg["init_args"], "save_dir", str(run_dir), f"logger[{lg['class_path'].rsplit('.', 1)[-1]}]")
    for cb in list(t.get("callbacks") or []) + [c for c in (cfg.get("callbacks") or {}).values() if c]:  # + named
        a = cb.setdefault("init_args", {})
        name = cb["class_path"].rsplit(".", 1)[-1]
        if name == "ModelCheckpoint":
            put(a, "dirpath", str(run_dir / "checkpoints"), name)
            put(a, "save_last", False, name)  # a 3B checkpoint with fp32 masters is ~60 GB: not part of the step
        if name == "SynthesisCallback":
            put(a, "mode", synthesis, name)
            if synthesis != "off":
                if a.get("strategy", "method") == "method":  # random weights describe nothing: offline descriptions
                    put(a, "offline_descriptions", str(next(toy.glob("*offline_descriptions.jsonl"))), name)
                over = dict(a.get("server_overrides") or {})
                # on GPUs the config's own server GPU stays (a 2-GPU config puts the server on GPU 1 or shares GPU 0)
                keep = "devices" in over and not ctx.get("smoke")
                over.update({k: v for k, v in ctx["server_overrides"].items() if not (k == "devices" and keep)})
                put(a, "server_overrides", over, name)
    for item in ctx.get("set") or []:  # --set data.init_args.batch_size=20 (weak scaling), recorded like the rest
        key, _, value = item.partition("=")
        *parents, leaf = key.split(".")
        node = cfg
        for k in parents:
            node = node.setdefault(k, {})
        put(node, leaf, yaml.safe_load(value), key.rsplit(".", 1)[0] if parents else "config")
    return changed


# ------------------------------------------------------------------------------------------------------------ reading
def read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                rows.append(json.loads(line))
    return rows


def step_times(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step wall times from the metrics file. A delta that spans a validation (epoch boundary: validation, the
    swap, a sync wait) is reported apart, not as a step."""
    train = [r for r in rows if r.get("event") == "train"]
    start = next((r for r in rows if r.get("event") == "start" and r.get("stage") == "fit"), None)
    if not train or start is None:
        return {}
    times, boundary, prev_t, prev_epoch = [], [], start["time"], train[0]["epoch"]
    for r in train:
        dt = r["time"] - prev_t
        (boundary if r["epoch"] != prev_epoch else times).append(round(dt, 3))
        prev_t, prev_epoch = r["time"], r["epoch"]
    steady = times[1:] if len(times) > 1 else times
    epochs: dict[int, list[float]] = {}
    for r in train:
        epochs.setdefault(r["epoch"], []).append(r["time"])
    return {
        "steps": len(train),
        "step_s": times,
        "first_step_s": times[0] if times else None,
        "median_step_s": round(statistics.median(steady), 3) if steady else None,
        "boundary_step_s": boundary,
        "fit_wall_s": round(train[-1]["time"] - start["time"], 1),
    }


def synth_figures(run_dir: Path, fit_start: float | None, fit_end: float | None) -> dict[str, Any]:
    files = sorted(p for p in (run_dir / "synth").rglob("*") if p.is_file() and not p.name.startswith("."))
    mtimes = sorted(p.stat().st_mtime for p in files)
    out: dict[str, Any] = {"images_written": len(files)}
    if fit_start is not None and fit_end is not None:
        during = [t for t in mtimes if fit_start <= t <= fit_end]
        out["images_during_training"] = len(during)
        if len(during) >= 2:
            out["server_images_per_s_while_training"] = round((len(during) - 1) / (during[-1] - during[0]), 3)
    csvs = sorted(run_dir.rglob("metrics.csv"))
    if csvs:
        import pandas as pd

        df = pd.read_csv(csvs[-1])
        for col in ("synth/swaps", "synth/failures", "synth/dropped", "synth/pool_swapped", "synth/submitted"):
            if col in df:
                vals = df[col].dropna()
                if len(vals):
                    out[col.split("/", 1)[1]] = float(vals.iloc[-1])
    return out


# ------------------------------------------------------------------------------------------------------------ runs
def _overlay_path(name: str) -> Path:
    """An overlay of ``--runs config+overlay``: a baseline (configs/baselines/) or an overlay (configs/overlays/)."""
    for folder in ("baselines", "overlays"):
        path = REPO / "configs" / folder / f"{name}.yaml"
        if path.exists():
            return path
    raise SystemExit(f"--runs: no overlay {name!r} in configs/baselines/ or configs/overlays/")


def _run_name(spec: str) -> str:
    """A run spec (``config+overlay:mode``) as a folder name."""
    return spec.replace(":", "_").replace("+", "_")


def run_fit(spec: str, ctx: dict[str, Any], timeout: float) -> dict[str, Any]:
    import yaml

    cfg_part, _, synthesis = spec.partition(":")
    synthesis = synthesis or "off"
    names = cfg_part.split("+")
    paths = [REPO / "configs" / f"{names[0]}.yaml"] + [_overlay_path(n) for n in names[1:]]
    run_dir = Path(ctx["work"]) / "runs" / _run_name(spec)
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    cfg = compose(paths)
    changed = swap_paths_and_lengths(cfg, ctx=ctx, run_dir=run_dir, synthesis=synthesis)
    cfg_path = run_dir / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    cmd = [sys.executable, "train.py", "fit", "--config", str(cfg_path)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    t0 = time.time()
    log = run_dir / "train.log"
    with log.open("w") as fh:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    wall = time.time() - t0
    rows = read_jsonl(run_dir / "metrics.jsonl")
    r: dict[str, Any] = {
        "command": "python " + " ".join(cmd[1:]),
        "configs": [str(p.relative_to(REPO)) for p in paths],
        "synthesis": synthesis,
        "overridden": changed,
        "rc": rc,
        "process_wall_s": round(wall, 1),
        **step_times(rows),
    }
    train = [x for x in rows if x.get("event") == "train"]
    if train:
        peaks = [x["train/peak_mem_gib"] for x in train if "train/peak_mem_gib" in x]
        if peaks:
            r["peak_mem_gib"] = round(max(peaks), 1)
        r["completion_length"] = round(statistics.mean(x.get("train/completion_length", 0) for x in train), 1)
        r.update(mask_figures(train))
        start = next(x for x in rows if x.get("event") == "start")
        r.update(synth_figures(run_dir, start["time"], train[-1]["time"]))
        if r.get("median_step_s"):
            r["paper_epoch_s_extrapolated"] = round(PAPER_EPOCH_STEPS * r["median_step_s"], 1)
            r["paper_epoch_note"] = (
                f"extrapolated: {PAPER_EPOCH_STEPS} x the median measured step; the measured run had "
                f"{len(train)} steps over {ctx['epochs']} epochs"
            )
    if rc != 0:
        r["log_tail"] = log.read_text()[-3000:]
    print(f"[fit {spec}] rc={rc} median step {r.get('median_step_s')} s, peak {r.get('peak_mem_gib')} GiB", flush=True)
    return r


def mask_figures(train: list[dict[str, Any]]) -> dict[str, Any]:
    """A CycleGRPO run with VQ-SAM2 masks: its tokenizer's seconds per step against the step, after the first (warm-up)
    step; empty for other runs."""
    rows = [x for x in train[1:] if x.get("train/cycle/mask_decode_s") is not None]
    if not rows:
        return {}
    step = sum(sum(v for k, v in x.items() if k.startswith("train/time/")) for x in rows)
    decode = sum(x["train/cycle/mask_decode_s"] for x in rows)
    encode = sum(x["train/cycle/mask_encode_s"] for x in rows)
    return {
        "mask_steps": len(rows),
        "mask_decodes_per_step": round(sum(x["train/cycle/mask_decodes"] for x in rows) / len(rows), 1),
        "mask_decode_s_per_step": round(decode / len(rows), 3),
        "mask_decode_share": round(decode / step, 4) if step else None,
        "mask_tokenizer_share": round((decode + encode) / step, 4) if step else None,
    }


def run_profile(spec: str, ctx: dict[str, Any], steps: int, timeout: float) -> dict[str, Any]:
    """``bench/profile_step.py`` (a component profiler around ``train.py fit``) on the config ``run_fit`` composed for
    ``spec``: the same paths and lengths, its own run folder, 2 warm-up steps and ``steps`` profiled."""
    src = Path(ctx["work"]) / "runs" / _run_name(spec) / "config.yaml"
    if not src.exists():
        return {"error": f"no composed config for {spec!r} at {src}: --profile reads the first --runs entry's"}
    out = Path(ctx["work"]) / "profile" / f"{_run_name(spec)}.json"
    run_dir = out.parent / "run"
    shutil.rmtree(run_dir, ignore_errors=True)
    cmd = [sys.executable, "bench/profile_step.py", "--config", str(src), "--steps", str(steps), "--warmup", "2"]
    cmd += [
        "--top",
        "40",
        "--trace",
        str(out.with_suffix(".trace.json")),  # the Chrome trace (open it in Perfetto), beside the summary
        "--out",
        str(out),
        "--",
        f"--trainer.default_root_dir={run_dir}",
        "--trainer.max_epochs=1000",
    ]
    env = dict(os.environ, PYTHONUNBUFFERED="1", WANDB_MODE="offline", TOKENIZERS_PARALLELISM="false")
    log = out.with_suffix(".log")
    out.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as fh:
        try:
            rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    r: dict[str, Any] = {
        "command": "python " + " ".join(cmd[1:]),
        "rc": rc,
        "note": "component profiler (torch.profiler)",
    }
    if rc == 0 and out.exists():
        r.update(json.loads(out.read_text()))
    else:
        r["log_tail"] = log.read_text()[-3000:]
    print(f"[profile {spec}] rc={rc} mean step {r.get('mean_step_s')} s", flush=True)
    return r


def prompt_text_tokens(ctx: dict[str, Any], template: str = "syn_grpo") -> int:
    """Text tokens (vision start / end included, the image pads not) of a REC prompt with this tokenizer."""
    from transformers import AutoProcessor

    from lightning_modules.models.prompts import build_prompt_text

    proc = AutoProcessor.from_pretrained(ctx["model_dir"])
    text = build_prompt_text(proc, "the small red circle", task="rec", template=template)
    ids = proc.tokenizer(text)["input_ids"]
    return len(ids) - 1 + 2  # the one <|image_pad|> placeholder out; vision start / end are in the text already


def run_trl(ctx: dict[str, Any], steps: int) -> dict[str, Any]:
    """TRL on the same work, fp32 parameters under bf16 autocast (fp32 master weights, as our run)."""
    import torch

    from bench import grpo_step

    args = argparse.Namespace(
        prompts=20,
        group=6,
        new_tokens=256 if not ctx.get("smoke") else 8,
        image_size=448 if not ctx.get("smoke") else 56,
        text_tokens=ctx["prompt_text_tokens"],
        micro_batch=8 if not ctx.get("smoke") else 4,
        trl_steps=steps,
    )
    if ctx.get("smoke"):
        args.prompts, args.group = 2, 2
    device = torch.device("cuda" if torch.cuda.is_available() and not ctx.get("smoke") else "cpu")
    result: dict[str, Any] = {}
    grpo_step.run_trl(ctx["arch"], args, device, torch.float32, result, lambda: None)
    r = result["trl_runs"][ctx["arch"]]
    times = r.get("step_s", [])
    after = times[1:] if len(times) > 1 else times
    r["median_step_after_first_s"] = round(statistics.median(after), 2) if after else None
    r["precision"] = "fp32 parameters, bf16 autocast (HF Trainer bf16=True): fp32 master weights and AdamW state"
    r["work"] = vars(args)
    return r


SERVER_VARIANTS = ("plain", "sam2_extend")
"""``plain``: the kept foreground is each box, the canvas the image's; ``sam2_extend``: the paper configs' server, SAM 2
(``configs/synth/sdxl.yaml``'s masker; random weights of the hiera-large architecture) and the canvas extended by a
factor drawn per job in [0, 0.5] (the paper configs' ``extend``), centred (placement does not change the work)."""


def run_server(
    ctx: dict[str, Any], sides: list[int], jobs: int, batch: int, variants: Sequence[str] = ("plain",)
) -> dict[str, Any]:
    """The SDXL data server alone, through its HTTP API, at each long side and server variant (`SERVER_VARIANTS`):
    images/s over ``jobs`` jobs, each variant its own server, started in turn on the same GPU."""
    from PIL import Image

    for variant in variants:
        if variant not in SERVER_VARIANTS:
            raise ValueError(f"--server-variants: {variant!r} is not one of {SERVER_VARIANTS}")
    toy = ctx["toy"]["rec"]
    recs = [json.loads(x) for x in (toy / "train.jsonl").read_text().splitlines()]
    descs = [json.loads(x)["description"] for x in (toy / "train_offline_descriptions.jsonl").read_text().splitlines()]
    out: dict[str, Any] = {}
    for side in sides:
        # COCO-like canvases: each toy scene resized so its long side is `side` (a 4:3 crop, like a 640 x 480 photo)
        src = Path(ctx["work"]) / f"server_{side}"
        shutil.rmtree(src, ignore_errors=True)
        src.mkdir(parents=True)
        h = side * 3 // 4
        scenes = []
        for i, rec in enumerate(recs[:32]):
            im = Image.open(toy / rec["image"]).convert("RGB")
            sx, sy = side / im.width, h / im.height
            im.resize((side, h)).save(src / f"{i}.png")
            b = rec["solution"] if isinstance(rec["solution"][0], (int, float)) else rec["solution"][0]
            scenes.append((src / f"{i}.png", [[b[0] * sx, b[1] * sy, b[2] * sx, b[3] * sy]]))
        for variant in variants:
            row = _server_variant(ctx, variant, side, src, scenes, descs, jobs, batch)
            key, n = f"{side}/{variant}", 2
            while key in out:  # a variant listed twice (a repeat in the same call) keeps every run
                key, n = f"{side}/{variant}#{n}", n + 1
            out[key] = dict(row, canvas=[side, h])
            print(f"[server {side} {variant}] {row['images_per_s']} images/s ({row['ok']}/{jobs} ok)", flush=True)
    return out


def _server_variant(
    ctx: dict[str, Any], variant: str, side: int, src: Path, scenes: list, descs: list[str], jobs: int, batch: int
) -> dict[str, Any]:
    """One server of ``variant`` at long side ``side``: a warm-up batch, then ``jobs`` jobs submitted at once."""
    import random

    from synth.api import CanvasParams, ImageRef, JobRequest
    from synth.client import LocalServer

    over = {k: v for k, v in ctx["server_overrides"].items() if not k.startswith("foreground")}
    over.update({"batch_size": batch, "max_queued": jobs + 16, "painter.resolution": side, "painter.max_batch": batch})
    if variant == "plain":
        over["foreground"], extend = {"name": "box"}, (0.0, 0.0)
    else:  # dtype null: bfloat16 on the GPU, as configs/synth/sdxl.yaml
        over["foreground"], extend = {"name": "sam2", "path": ctx["sam2_dir"], "dtype": None}, (0.0, 0.5)
    draw = random.Random(0)
    factors = [round(draw.uniform(*extend), 4) for _ in range(max(jobs, batch))]

    def req(i: int, prefix: str) -> JobRequest:
        path, boxes = scenes[i % len(scenes)]
        return JobRequest(
            job_id=f"{prefix}-{i}",
            sample_id=f"s{i % len(scenes)}",
            image=ImageRef(path=str(path)),
            boxes=boxes,
            description=descs[i % len(descs)],
            seed=i,
            canvas=CanvasParams(extend=factors[i]),
        )

    t_start = time.perf_counter()
    with LocalServer(
        REPO / "configs/synth/sdxl.yaml",
        roots=[src],
        output_dir=src / f"out_{variant}",
        overrides=over,
        startup_timeout=900,
        log_path=src / f"server_{variant}.log",
    ) as server:
        startup = time.perf_counter() - t_start
        with server.client(timeout=120) as client:
            warm = [req(i, "warm") for i in range(batch)]  # first batch: kernels, allocator
            for r in warm:
                client.submit(r)
            client.wait([r.job_id for r in warm], timeout=600)
            reqs = [req(i, "bench") for i in range(jobs)]
            t0 = time.perf_counter()
            for r in reqs:
                client.submit(r)
            done = client.wait([r.job_id for r in reqs], timeout=1200, poll_interval=0.05)
            wall = time.perf_counter() - t0
    results = [st.result for st in done.values() if st.result is not None]
    audits = [r.audit.passed for r in results if r.audit is not None]
    paint = [st.timings.paint_s for st in done.values() if st.timings.paint_s is not None]
    run = [st.timings.run_s for st in done.values() if st.timings.run_s is not None]
    return {
        "variant": variant,
        "foreground": over["foreground"]["name"],
        "extend_range": list(extend),
        "mean_output_pixels": round(statistics.mean(r.width * r.height for r in results)) if results else None,
        "working_size_long_side": side,
        "jobs": jobs,
        "ok": sum(st.state == "done" for st in done.values()),
        "audit_passed": sum(audits),
        "batch": batch,
        "images_per_s": round(jobs / wall, 3),
        "wall_s": round(wall, 1),
        "server_startup_s": round(startup, 1),
        "median_batch_paint_s": round(statistics.median(paint), 3) if paint else None,
        "median_batch_run_s": round(statistics.median(run), 3) if run else None,
    }


# ------------------------------------------------------------------------------------------------------------ main
def machine() -> dict[str, Any]:
    import torch
    import transformers

    info = {
        "date": datetime.date.today().isoformat(),
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="", help="comma list of config[+overlay...]:off|async|sync")
    ap.add_argument("--trl", action="store_true", help="TRL's GRPOTrainer on the same work, in the same call")
    ap.add_argument("--trl-steps", type=int, default=2)
    ap.add_argument(
        "--profile",
        type=int,
        default=0,
        help="N: after the fits, bench/profile_step.py on the first run's composed config (2 warm-up steps, N profiled)",
    )
    ap.add_argument("--parity", action="store_true", help="engine parity on the real architecture")
    ap.add_argument("--server", default="", help="comma list of long sides for the data-server-alone bench")
    ap.add_argument("--server-jobs", type=int, default=64)
    ap.add_argument("--server-batch", type=int, default=8)
    ap.add_argument(
        "--server-variants", default="plain", help=f"comma list of {', '.join(SERVER_VARIANTS)} (--server runs each)"
    )
    ap.add_argument("--arch", default="3b", help="3b | 7b (Qwen2.5-VL) | qwen3vl-4b (Qwen3-VL: configs/cycle_4b.yaml)")
    ap.add_argument("--work", default="/tmp/e2e")
    ap.add_argument("--train-samples", type=int, default=60, help="3 steps per epoch at 20 prompts")
    ap.add_argument("--val-samples", type=int, default=16)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--video-size", type=int, default=224, help="frame side of the toy video clips (video configs)")
    ap.add_argument("--synth-resolution", type=int, default=640, help="the SDXL server's long side in fit runs")
    ap.add_argument("--timeout", type=float, default=480, help="seconds per fit run")
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny architectures: a check of the harness itself")
    ap.add_argument("--out", default=None, help="results JSON (merged into an existing one)")
    ap.add_argument(
        "--set",
        action="append",
        default=[],
        help="KEY=VALUE (YAML) on every run's composed config, e.g. data.init_args.batch_size=20; repeatable",
    )
    args = ap.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and not args.smoke
    device = "cuda" if cuda else "cpu"
    if args.smoke:
        args.arch = "qwen3vl-tiny" if args.arch in QWEN3_VL else "tiny"
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    ctx: dict[str, Any] = {
        "work": str(work),
        "arch": args.arch,
        "smoke": args.smoke,
        "epochs": args.epochs,
        "train_samples": args.train_samples if not args.smoke else 4,
        "val_samples": args.val_samples if not args.smoke else 2,
        "set": args.set,
        "device": device,
    }
    builds: dict[str, Any] = {}
    builds["qwen"] = build_qwen(
        work / f"qwen-{args.arch}", args.arch, device, vocab_size=4096 if not args.smoke else 512
    )
    ctx["model_dir"] = builds["qwen"]["path"]
    need_sdxl = args.server or any(":async" in r or ":sync" in r for r in args.runs.split(","))
    if need_sdxl:
        builds["sdxl"] = build_sdxl(
            work / f"sdxl-{'tiny' if args.smoke else 'full'}", "tiny" if args.smoke else "full", device
        )
        sd = builds["sdxl"]["path"]
        builds["sam2"] = build_sam2(
            work / f"sam2-{'tiny' if args.smoke else 'large'}", "tiny" if args.smoke else "large"
        )
        ctx["server_overrides"] = {
            "devices": [f"{device}:0" if cuda else "cpu"],
            "painter.model": sd,
            "painter.controlnet": str(Path(sd) / "controlnet"),
            "painter.vae": None,
            "painter.resolution": args.synth_resolution if not args.smoke else 64,
            "startup_timeout_s": 900,
            # configs/synth/sdxl.yaml's SAM 2 (sam2.1-hiera-large) with random weights: its compute, not its masks
            "foreground.path": builds["sam2"]["path"],
        }
        ctx["sam2_dir"] = builds["sam2"]["path"]
    size = 448 if not args.smoke else 112
    n_train = max(ctx["train_samples"], 32)
    ctx["toy"] = {task: export_toy(work, task, n_train, ctx["val_samples"], size) for task in ("rec", "ovd")}
    video_size = args.video_size if not args.smoke else 112
    ctx["toy"]["video"] = export_toy_video(work, n_train, ctx["val_samples"], video_size)
    builds["build_s"] = round(time.perf_counter() - t0, 1)
    ctx["prompt_text_tokens"] = prompt_text_tokens(ctx)

    out = Path(args.out) if args.out else None
    result: dict[str, Any] = json.loads(out.read_text()) if out and out.exists() else {}
    result.setdefault("harness", __doc__.split("\n\n")[0])
    result.setdefault("calls", []).append({"command": "python " + " ".join(sys.argv), **machine(), "builds": builds})

    def save() -> None:
        if out:
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(result, indent=1, default=str) + "\n")

    save()
    for spec in [s for s in args.runs.split(",") if s]:
        result.setdefault("fit", {})[spec] = {**machine(), **run_fit(spec, ctx, args.timeout)}
        save()
    if args.profile and args.runs:
        result["profile"] = {**machine(), **run_profile(args.runs.split(",")[0], ctx, args.profile, args.timeout)}
        save()
    if args.parity:  # its own process, so its GPU memory is gone before anything else runs
        parity_out = work / "parity.json"
        cmd = [sys.executable, "bench/engine_parity.py", "--model", ctx["model_dir"], "--out", str(parity_out)]
        cmd += ["--device", device] + (["--smoke"] if args.smoke else [])
        rc = subprocess.run(cmd, cwd=REPO, timeout=args.timeout).returncode
        parity = json.loads(parity_out.read_text()) if rc == 0 and parity_out.exists() else {"rc": rc}
        result["parity"] = {**machine(), "command": "python " + " ".join(cmd[1:]), **parity}
        save()
    if args.trl:
        try:
            result["trl"] = {**machine(), **run_trl(ctx, args.trl_steps)}
        except Exception as err:  # report, never fake
            import traceback

            traceback.print_exc()
            result["trl"] = {"error": f"{type(err).__name__}: {err}"[:800]}
        ours = result.get("fit", {}).get("rec_3b_1gpu:off", {}).get("median_step_s")
        trl = result["trl"].get("median_step_after_first_s")
        if ours and trl:
            result["trl_over_ours"] = round(trl / ours, 2)
        save()
        import gc

        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    if args.server:
        sides = [int(s) for s in args.server.split(",")]
        result.setdefault("server", {}).update(
            {
                **machine(),
                **run_server(
                    ctx,
                    sides,
                    args.server_jobs if not args.smoke else 4,
                    args.server_batch,
                    [v for v in args.server_variants.split(",") if v],
                ),
            }
        )
        save()
    print(json.dumps({k: v for k, v in result.items() if k != "calls"}, indent=1, default=str)[:6000])
    return result


if __name__ == "__main__":
    main()
