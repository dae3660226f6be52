"""Every training config under ``configs/`` runs real fit steps through ``train.py`` on the CPU.

"It parses" says nothing about whether a config runs (a GPU config once asked the synthesis callback for a pool its
data module did not have, and nothing caught it). Each config (bases, the toy SFT stages on ``toy_sft.yaml``, and
every baseline overlay on the one-GPU paper base) is composed exactly as the CLI composes it, then only these are
swapped for the CPU: model path -> the embedded toy checkpoint, data paths -> toy-world JSONL written under the
config's own file names, accelerator / devices / strategy -> one CPU process (multi-GPU bases run as one process, an
FSDP2 config under FSDP2 on that one process; tests/cli/test_fsdp.py runs several), the data server -> the procedural painter, and lengths (2 epochs of 2 steps,
96 new tokens, the toy prompt for the Syn-GRPO format, one eval batch). Precision is kept: the paper configs run ``bf16-true`` with fp32 master weights here
too, so their numerics path is what runs. Each run runs in its own folder (relative output paths land there).
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from tests.judge_server import toy_judge_for_config
from train import cli_main

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
TOY_CKPT = REPO / "checkpoints/toy-qwen2.5-vl"
BASES = sorted(p for p in CONFIGS.glob("*.yaml") if "_stage" not in p.stem)
STAGES = sorted(CONFIGS.glob("toy_sft_stage*.yaml"))
OVERLAYS = sorted((CONFIGS / "baselines").glob("*.yaml"))
RUNS = (
    [(b,) for b in BASES]
    + [(CONFIGS / "toy_sft.yaml", s) for s in STAGES]
    + [(CONFIGS / "rec_3b_1gpu.yaml", o) for o in OVERLAYS]
    + [(CONFIGS / "evolved_tiny.yaml", o) for o in sorted((CONFIGS / "overlays").glob("evolved_*.yaml"))]
    + [(CONFIGS / "cycle_tiny.yaml", o) for o in sorted((CONFIGS / "overlays").glob("cycle_tiny_*.yaml"))]
    + [(CONFIGS / "cycle_tiny.yaml", CONFIGS / "overlays/cycle_judge.yaml")]  # against the toy judge server
    + [(CONFIGS / "rec_3b_1gpu.yaml", CONFIGS / "overlays/shared_prompt.yaml")]  # each prompt once per group
    + [(CONFIGS / "cycle_4b.yaml", CONFIGS / "overlays/hf_engines.yaml")]  # the transformers engines on Qwen3-VL
    + [(CONFIGS / "cycle_4b_temporal.yaml", CONFIGS / "overlays/hf_engines.yaml")]  # ... and on its clips
    + [(CONFIGS / "cycle_4b.yaml", CONFIGS / "overlays/cycle_4b_parquet.yaml", CONFIGS / "overlays/hf_engines.yaml")]
)


VARIANT_BASES = (
    CONFIGS / "rec_3b_1gpu.yaml",
    CONFIGS / "evolved_tiny.yaml",
    CONFIGS / "cycle_tiny.yaml",
    CONFIGS / "cycle_4b.yaml",
    CONFIGS / "cycle_4b_temporal.yaml",
)
"""The baselines, ablations and engine overlays on these bases change a few arguments of a base that runs in the default
suite: they run in ``make test-slow`` (CI runs both), the judge overlay among them (the judge in CycleGRPO's step:
tests/lightning_modules/test_cycle_judge.py, by default); the released-parquet overlay (three configs) runs by
default."""

CONTINUATIONS = {
    "toy_sft_stage_base3",
    "toy_sft_stage_base4",
    "toy_sft_stage2",
    "toy_sft_stage3",
    "toy_sft_stage4",
    "toy_sft_stage_evolved_anchors",
    "toy_sft_stage_evolved_chains_anchor",
    "toy_sft_stage_evolved_long",
}
"""Stages that continue an earlier stage on its module, data path and targets and change its steps, batch, mix
weights or paths: the new base's stages 3-4 (stage 2's mix, which runs by default), the committed checkpoint's stages
2-4 (the toy mixes of the base's stages), the EvolvedGRPO stages that change the first's steps or mix (its `toy_steps`
target; the named variant's own target and the chains' multi-hop scenes run by default). Their fits run in ``make test-slow``."""


HARDWARE_VARIANTS = (
    {
        f"{name}.yaml"
        for name in (
            "rec_3b",
            "rec_3b_2gpu",
            "rec_3b_2gpu_split",
            "rec_3b_80gb",
            "rec_7b_2gpu",
            "rec_7b_1gpu",
            "ovd_3b",
        )
    }
    | {
        f"{name}.yaml"
        for name in ("cycle_st_7b", "evolved_question_7b", "evolved_answer_7b", "evolved_3b", "isr_3b", "ovd_3b_1gpu")
    }
    | {f"{n}.yaml" for n in ("evolved_question_3b_1gpu", "evolved_answer_3b_1gpu", "cycle_tiny_temporal", "tiny_isr")}
)
"""Configs whose task runs in the default suite in another config: the same task and model parts on other hardware
(rec_3b_1gpu, rec_7b; the DDP / FSDP2 / offload paths they switch on have tests of their own), the paper-size twin
of a toy config (cycle_tiny_st, evolved_question_tiny, evolved_answer_tiny, evolved_tiny, tiny_isr, tiny_ovd), or
the toy twin of a paper config (cycle_tiny_temporal: cycle_4b_temporal's interval cycle on the same toy clips), or
tiny_isr (tiny_ovd's OVD step on the ISR rooms; the ISR reader is tested on its release layout in tests/datamodules):
their fits run in ``make test-slow``."""


def _marks(run: tuple[Path, ...]) -> list[pytest.MarkDecorator]:
    variant = len(run) == 2 and run[0] in VARIANT_BASES
    continuation = len(run) == 2 and run[1].stem in CONTINUATIONS
    hardware = len(run) == 1 and run[0].name in HARDWARE_VARIANTS
    return [pytest.mark.slow] if variant or continuation or hardware else []


def _id(run: tuple[Path, ...]) -> str:
    return "+".join(p.relative_to(CONFIGS).with_suffix("").as_posix() for p in run)


def compose(paths: tuple[Path, ...]) -> dict:
    """The config exactly as ``train.py fit --config A --config B`` composes it."""
    args = ["fit"] + [a for p in paths for a in ("--config", str(p))] + ["--print_config"]
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        cli_main(args)
    return yaml.safe_load(buf.getvalue())


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory) -> dict[str, Path]:
    """A few toy scenes per task (REC and OVD), train and val, exported as VLM-R1 JSONL, plus offline descriptions."""
    from datamodules.toy import export_jsonl, export_offline_descriptions

    out = {}
    for task in ("rec", "ovd", "isr"):  # isr: the toy ISR rooms (OVD samples), for the ISR configs
        root = tmp_path_factory.mktemp(f"toy_{task}")
        export_jsonl(root, "train", 8, seed=0, task=task)
        export_jsonl(root, "val", 4, seed=0, task=task)
        export_offline_descriptions(root, "train", task=task)
        out[task] = root
    from datamodules import toy_video  # the video configs' data (datamodules.video.VideoGroundingDataModule)

    root = tmp_path_factory.mktemp("toy_video")
    toy_video.export_jsonl(root, "train", 8, seed=0)
    toy_video.export_jsonl(root, "val", 4, seed=0)
    out["video"] = root
    return out


def _data_dir(cfg: dict, toy: dict[str, Path], dest: Path) -> Path:
    """A data root holding every file the config names, each a copy of the toy train or val split of its task."""
    from datamodules import toy_video
    from datamodules.toy import jsonl_path

    model_args = cfg["model"]["init_args"]
    task = model_args.get("task", "rec")
    if any("isr" in str(f) for f in cfg["data"]["init_args"].get("train_files") or []):
        task = "isr"  # ISR's perception stage: OVD samples of the toy ISR rooms
    if cfg["data"]["class_path"].endswith("VideoGroundingDataModule"):
        task = "video"
        jsonl_path = lambda root, split, task: toy_video.jsonl_path(root, split)  # noqa: E731
    src = toy[task]
    shutil.copytree(src, dest)
    d = cfg["data"]["init_args"]
    for name in d.get("train_files") or []:
        shutil.copy(jsonl_path(src, "train", task), dest / name)
    for files in (d.get("val_files") or {}, d.get("test_files") or {}):
        for name in files.values():
            shutil.copy(jsonl_path(src, "val", task), dest / name)
    return dest


def cpu_swap(cfg: dict, toy: dict[str, Path], root: Path, qwen3_vl: Path | None = None) -> dict:
    """``qwen3_vl``: a tiny random Qwen3-VL, swapped in for a config whose model is a Qwen3-VL (its own classes,
    processor and box frame; the toy checkpoint is a Qwen2.5-VL)."""
    cfg = json.loads(json.dumps(cfg))
    t = cfg["trainer"]
    sft = cfg["model"]["class_path"].endswith("SFTModule")
    t.update(
        accelerator="cpu",
        devices=1,
        strategy="fsdp2" if t.get("strategy") == "fsdp2" else "auto",  # FSDP2 on one process: its sharding path
        num_nodes=1,
        max_epochs=2,
        max_steps=4 if sft else -1,
        limit_val_batches=1,
        limit_test_batches=1,
        num_sanity_val_steps=0,
        enable_progress_bar=False,
        log_every_n_steps=1,
        default_root_dir=str(root / "out"),
        val_check_interval=None if sft else t.get("val_check_interval"),
        check_val_every_n_epoch=1,
    )
    if sft:
        t["limit_train_batches"] = 2
    named = [cb for cb in (cfg.get("callbacks") or {}).values() if cb]
    for cb in (t.get("callbacks") or []) + named:
        a = cb.setdefault("init_args", {})
        if cb["class_path"].endswith("ModelCheckpoint"):
            if a.get("every_n_train_steps"):
                a["every_n_train_steps"] = 2
        if cb["class_path"].endswith("SynthesisCallback"):
            overrides = {}
            if str(a.get("server_config", "")).endswith("synth/sdxl.yaml"):  # a paper config: its SAM 2 segmenter
                overrides = sam2_foreground(root / "sam2-tiny")  # ... random weights, the procedural painter's canvas
            a.update(url=None, server_config=str(CONFIGS / "synth/procedural.yaml"), server_overrides=overrides)
            if a.get("offline_descriptions"):
                task = cfg["model"]["init_args"].get("task", "rec")
                a["offline_descriptions"] = str(next(toy[task].glob("*offline_descriptions.jsonl")))
    m = cfg["model"]["init_args"]
    p = m.setdefault("policy", {})
    qwen3 = "qwen3-vl" in str(p["model_name_or_path"]).lower()
    if qwen3 and qwen3_vl is None:
        raise ValueError(f"{p['model_name_or_path']} is a Qwen3-VL: pass cpu_swap(..., qwen3_vl=<tiny Qwen3-VL>)")
    p["model_name_or_path"] = str(qwen3_vl if qwen3 else TOY_CKPT)
    if sft:
        m.update(build_tiny=None, export_dir=str(root / "export"), eval_max_new_tokens=16)
    else:
        s = m.setdefault("sampling", {})
        # the toy model's whole Syn-GRPO completion (tiny.yaml's length); a random Qwen3-VL never stops: 24 tokens
        s["max_new_tokens"] = 24 if qwen3 else 96
        if s.get("prompt_template") == "syn_grpo":  # the toy checkpoint learnt Syn-GRPO's format under its own prompt
            s["prompt_template"] = "toy"
    d = cfg["data"]["init_args"]
    d.update(
        data_root=str(_data_dir(cfg, toy, root / "data")),
        image_root=None,
        batch_size=2,
        eval_batch_size=2,
        max_eval_samples=2,
        num_workers=0,
    )
    toy_spec = d.get("toy")
    if toy_spec and toy_spec.get("render_train"):  # SFT renders its train split on access: keep it, make it small
        d["toy"] = dict(toy_spec, splits={"train": 4, "val": 2, "ood": 2}, mix=toy_spec.get("mix") or {})
    else:
        d["toy"] = None
        d["max_train_samples"] = 4
    if d.get("video"):  # the video SFT stage's clips (datamodules.video.ImageVideoSFTDataModule): few, rendered
        d["video"] = dict(d["video"], train=4, val=2)
    method = m.get("method")
    if isinstance(method, dict) and (method.get("init_args") or {}).get("mask_tokenizer"):  # region_space: mask
        method["init_args"]["mask_tokenizer"] = str(tiny_mask_tokenizer(root / "mask-tokenizer"))
    if (m.get("mask_sft") or {}).get("mask_tokenizer"):  # the mask-token co-SFT (SFTModule.mask_sft)
        m["mask_sft"]["mask_tokenizer"] = str(tiny_mask_tokenizer(root / "mask-tokenizer"))
    if d.get("gres"):  # GRES (datamodules/cycle_seg.py): tests/datamodules/test_cycle_data.py's four val refs
        from tests.datamodules.test_cycle_data import write_gres_fixture

        f = write_gres_fixture(root / "gres")
        d["gres"] = {"grefs": str(f["grefs"]), "instances": str(f["instances"]), "image_root": str(f["images"])}
        d.update(gres=dict(d["gres"], split="val"), gres_val_split="val" if d.get("gres_val_split") else None)
    if d.get("parquet_files"):  # the released RL parquet (datamodules/cycle_seg.py): toy rows in its schema
        from datamodules.cycle_seg import export_toy_parquet
        from lightning_modules.models.mask_tokenizer.toy import ToyMaskTokenizer

        codec = ToyMaskTokenizer.load(tiny_mask_tokenizer(root / "mask-tokenizer"))
        d.update(parquet_image_root=None, parquet_files=[str(export_toy_parquet(root / "parquet/rl.parquet", codec))])
    if cfg["data"]["class_path"].endswith("ReasoningDataModule"):  # EvolvedGRPO's A and Q: a few toy math rows
        d.update(toy={"splits": {"train": 4, "val": 2}, "seed": 0}, data_root=str(root / "toy_math"), train_files=None,
                 val_files=None, test_files=None)  # fmt: skip
        if isinstance(method, dict) and "answer_model" in (method.get("init_args") or {}):  # Q's frozen A
            method["init_args"]["answer_model"] = str(TOY_CKPT)
    return cfg


def sam2_foreground(out: Path) -> dict:
    """Server overrides that segment the kept foreground with SAM 2 (``configs/synth/sdxl.yaml``'s masker): a tiny
    random-weight SAM 2 saved in ``out`` (``synth.random_sam2``), loaded by the worker from that folder."""
    from synth.random_sam2 import save_random_sam2

    if not (out / "config.json").is_file():
        save_random_sam2(out, "tiny")
    return {"foreground.name": "sam2", "foreground.path": str(out), "foreground.device": "cpu"}


def tiny_mask_tokenizer(out: Path) -> Path:
    """An untrained tiny toy mask tokenizer saved in ``out`` (milliseconds; seeded, the global RNG untouched): what
    a config's ``mask_tokenizer`` (checkpoints/toy-mask-tokenizer, not in git) is swapped for."""
    from lightning_modules.models.mask_tokenizer.toy import ToyMaskTokenizer, ToyVQConfig, ToyVQNet

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        net = ToyVQNet(ToyVQConfig(crop=16, width=8, latent=16))
    return ToyMaskTokenizer(net).save(out)


@pytest.fixture(scope="module")
def tiny_qwen3_vl(tmp_path_factory) -> Path:
    """A random tiny Qwen3-VL with the toy checkpoint's tokenizer (configs/cycle_4b.yaml's architecture)."""
    from lightning_modules.models.tiny_model import build_tiny_qwen3_vl

    return build_tiny_qwen3_vl(tmp_path_factory.mktemp("tiny-qwen3-vl"), TOY_CKPT)


@pytest.mark.parametrize("run", [pytest.param(r, marks=_marks(r)) for r in RUNS], ids=_id)
def test_config_runs_fit_steps_on_cpu(run, toy_data, tiny_qwen3_vl, tmp_path, monkeypatch):
    cfg = cpu_swap(compose(run), toy_data, tmp_path, qwen3_vl=tiny_qwen3_vl)
    if cfg["data"]["init_args"].get("max_train_samples"):  # one batch of 2 per epoch: 2 steps, 2 validations, a swap
        cfg["data"]["init_args"]["max_train_samples"] = 2
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    monkeypatch.chdir(tmp_path)  # relative output paths of the config (outputs/<name>/...) land in this run's folder
    with toy_judge_for_config(cfg, path) as judge:  # a method with a judge asks the toy judge (tests/judge_server.py)
        cli = cli_main(["fit", "--config", str(path)])
    trainer = cli.trainer
    judged = float(trainer.callback_metrics.get("train/cycle/judge_reward", float("nan")))  # nan: nothing judged
    assert not judge or judged >= 0.0, (judged, sorted(trainer.callback_metrics))
    assert trainer.global_step >= 2, f"{_id(run)} ran {trainer.global_step} steps"
    if cfg["trainer"]["strategy"] == "fsdp2":
        from lightning_modules.models.fsdp import is_sharded

        assert is_sharded(cli.model.policy) and all(p.dtype == torch.float32 for p in cli.model.policy.parameters())
    out = Path(t["default_root_dir"]) if (t := cfg["trainer"]).get("default_root_dir") else None
    metrics = [c for c in (cfg.get("callbacks") or {}).values() if c and c["class_path"].endswith("MetricsJSONL")]
    if metrics:  # every config and overlay (SFT included) writes the notebook's input into its run folder
        assert (out / "metrics.jsonl").is_file(), sorted(p.name for p in out.iterdir())
    ckpt = [c for c in (cfg.get("callbacks") or {}).values() if c and c["class_path"].endswith("ModelCheckpoint")]
    if ckpt:
        # a file, or under FSDP2 a distributed checkpoint (a folder of shards)
        assert (out / "checkpoints/last.ckpt").exists(), sorted(p.name for p in out.rglob("*.ckpt"))
    logged = trainer.callback_metrics
    if video := cfg["data"]["init_args"].get("video"):  # the video SFT stage also validates on clips, both spaces
        assert {f"val/{video['val_name']}/{k}" for k in ("interval/tiou", "anchor/st")} <= set(logged), sorted(logged)
    if cfg["model"]["init_args"].get("mask_sft"):  # the mask-token co-SFT validates its examples greedily
        assert any(k.endswith(("/mask_span_rate", "/caption_exact", "/no_target_acc")) for k in logged), sorted(logged)
    if cfg["model"]["class_path"].endswith("GRPOModule"):
        assert "train/reward/total" in trainer.logged_metrics or any(k.startswith("train/") for k in logged)
        assert any(k.startswith("val/") for k in logged), sorted(logged)
        if cfg["model"]["init_args"].get("method") == "cycle_grpo":
            # the cycle's locatability of captions (boxes, intervals, anchors)
            assert any(k.endswith("/locatability") for k in logged), sorted(logged)
        synth = [c for c in trainer.callbacks if type(c).__name__ == "SynthesisCallback"]
        # instruction evolution submits a job only for a sample whose group converged (and a visual edit drawn for it)
        evolves = synth and "levels" in synth[0].strategy.state_dict()
        if synth and synth[0].mode != "off" and synth[0].strategy.paints and not evolves:
            assert synth[0].totals["submitted"] > 0, synth[0].totals
            overrides = synth[0].server.server_overrides
            if overrides.get("foreground.name") == "sam2":  # a paper config: SAM 2 kept the objects
                assert synth[0].totals["failed"] == 0, synth[0].history  # (the worker loads it at start, or fails)
            if synth[0].jobs.canvas.extend_range[1] > 0:  # outpainting: some canvas grew past the toy scene's 224 x 224
                sizes = [Image.open(f).size for f in out.rglob("*.png") if f.parent.name == "synth"]
                assert sizes and max(w * h for w, h in sizes) > 224 * 224, sizes
        elif synth and synth[0].mode != "off":  # instruction evolution: every trained sample has a level
            assert synth[0].strategy.state_dict()["levels"]["levels"] and synth[0].history, synth[0].history
    masks = getattr(getattr(cli.model, "method", None), "masks", None)
    if masks is not None:  # region_space: mask: samples bound to the tokenizer, the policy holds the mask tokens
        assert masks._cache and "<|mt_start|>" in cli.model.processor.tokenizer.get_vocab()
