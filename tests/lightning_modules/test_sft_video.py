"""The video SFT stage of the cycle checkpoint (configs/toy_sft_stage_cycle_video.yaml): its clip samples are exactly
what CycleGRPO's video path asks and scores as right (consistency 1), batches are all images or all clips, and real
fit steps on clips lower the loss and log the clip metrics, with a tiny random Qwen2.5-VL (the conftest factory)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
import yaml
from method_util import build_test_method  # tests/lightning_modules is on sys.path under pytest
from test_cycle_grpo import _rollout  # the stand-in rollout (tests/lightning_modules is on sys.path)

from core.regions import NO_TARGET, caption_phi, region_space
from datamodules.toy import ToySceneDataset
from datamodules.video import MixedBatches, ToyClipDataset
from lightning_modules.methods.cycle_grpo import caption_text, raw_caption
from lightning_modules.models.loading import load_policy
from lightning_modules.models.prompts import build_prompt_text
from lightning_modules.sft import SFTModule
from train import cli_main

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
RL_CONFIGS = {"interval": "cycle_tiny_temporal.yaml", "anchor": "cycle_tiny_st.yaml"}


def _stage() -> dict:
    return yaml.safe_load((CONFIGS / "toy_sft_stage_cycle_video.yaml").read_text())["model"]["init_args"]


def _rl(space: str) -> dict:
    return yaml.safe_load((CONFIGS / RL_CONFIGS[space]).read_text())["model"]["init_args"]


def test_the_stage_teaches_the_prompts_of_the_cycle_video_configs():
    """The stage continues the cycle checkpoint (what toy_sft_stage_cycle.yaml exports) and writes its own; its clip
    prompts are those configs/cycle_tiny_{temporal,st}.yaml ask with: the grounding template of each space, the
    captioning template, tau."""
    stage = _stage()
    cycle = yaml.safe_load((CONFIGS / "toy_sft_stage_cycle.yaml").read_text())["model"]["init_args"]
    assert stage["policy"]["model_name_or_path"] == cycle["export_dir"] == "checkpoints/toy-qwen2.5-vl-cycle"
    assert stage["export_dir"] == "checkpoints/toy-qwen2.5-vl-cycle-video" and stage["build_tiny"] is None
    for space in ("interval", "anchor"):
        rl = _rl(space)
        assert rl["method"]["init_args"]["region_space"] == space
        assert stage["video_templates"][space] == rl["sampling"]["prompt_template"]
        assert stage["caption_template"] == rl["method"]["init_args"]["caption_template"]
    assert stage["video_tau"] == _rl("anchor")["method"]["init_args"]["tau"]
    assert stage["video_spaces"] == ["interval", "anchor"]


@pytest.fixture(scope="module")
def clips() -> list:
    """Toy training clips: targets of every cue, and some no-target queries (10% of the split)."""
    ds = ToyClipDataset("train", 40, seed=0)
    out = [ds[i] for i in range(40)]
    assert any(not c.intervals for c in out) and sum(bool(c.intervals) for c in out) >= 4
    return out


@pytest.mark.parametrize("space", ["interval", "anchor"])
def test_clip_samples_are_what_cycle_grpo_asks_and_scores_right(tiny_model_dir, clips, space):
    """Per clip, the captioning and the grounding sample of ``space`` (forced by ``caption_frac`` 1 / 0): prompts
    written out from the RL config by hand; targets scored by CycleGRPO itself (built as the RL config builds it) on a
    rollout of those texts: every grounding's consistency is 1 (no-target queries included: their own grounding group),
    every caption clean
    (Phi 0) and stripped to the query the grounding prompt is then asked with."""
    stage, rl = _stage(), _rl(space)
    _, processor = load_policy(str(tiny_model_dir), dtype="fp32")
    args = dict(video_spaces=[space], video_templates=stage["video_templates"], video_tau=stage["video_tau"])
    captioner = SFTModule(policy={"model_name_or_path": str(tiny_model_dir)}, caption_frac=1.0, **args)
    grounder = SFTModule(policy={"model_name_or_path": str(tiny_model_dir)}, caption_frac=0.0, **args)
    captioner.processor = grounder.processor = processor
    hp = SimpleNamespace(prompt_template=rl["sampling"]["prompt_template"], advantage_scale="group", advantage_eps=0.0)
    method_args = {k: v for k, v in rl["method"]["init_args"].items() if k != "mode"}
    m = build_test_method("cycle_grpo", hp, dict(method_args, n_captions=2, k_groundings=2))
    space_obj = region_space(space)
    grounding_template = rl["sampling"]["prompt_template"]
    for clip in clips:
        g_prompt, g_target = grounder.examples.clip_example(processor, clip)
        assert g_prompt == build_prompt_text(processor, clip.query, template=grounding_template, video=True)
        gt = clip.region(space)
        if gt is NO_TARGET:
            assert g_target == "<answer>no target</answer>"
            assert captioner.examples.clip_example(processor, clip) == (g_prompt, g_target)
            # not cycled: its query grounded in a group of the config's no_target_groundings rows
            s = m.score([clip], _rollout([g_target] * m.K0, [1] * m.K0, (112, 112)))
            assert (
                s.parts["consistency"].tolist() == [1.0] * m.K0
                and m.K0 == rl["method"]["init_args"]["no_target_groundings"]
            )
            continue
        c_prompt, c_target = captioner.examples.clip_example(processor, clip)
        # the clip's frames are 112 px at their native size: the model reads and writes boxes in the frame's pixels
        caption_template = method_args["caption_template"]
        assert c_prompt == build_prompt_text(processor, space_obj.serialize(gt), template=caption_template, video=True)
        assert c_target == f"<answer>{clip.query}</answer>" and caption_text(c_target) == clip.query
        assert caption_phi(raw_caption(c_target)) == 0.0  # no leak, not empty, no repetition
        assert m.regions.grounding_prompt(processor, caption_text(c_target), grounding_template) == g_prompt
        s = m.score([clip], _rollout([c_target] * 2 + [g_target] * 4, [0, 0, 1, 1, 2, 2], (112, 112)))
        assert s.parts["consistency"].tolist() == [1.0] * 6
        assert s.total.tolist() == [1.0] * 6 if space == "interval" else s.total.tolist() == [1.0] * 2 + [1.5] * 4
        assert space_obj.parse(raw_caption(g_target)) == space_obj.normalize(gt)


def test_clips_pick_a_space_and_a_direction_by_id(tiny_model_dir, clips):
    m = SFTModule(policy={"model_name_or_path": str(tiny_model_dir)}, caption_frac=0.5)
    _, m.processor = load_policy(str(tiny_model_dir), dtype="fp32")
    spaces = [m.examples.space_for(c) for c in clips]
    assert set(spaces) == {"interval", "anchor"} and spaces == [m.examples.space_for(c) for c in clips]
    prompts = [m.examples.clip_example(m.processor, c)[0] for c in clips]
    assert any("Describe: " in p for p in prompts) and any("When: " in p for p in prompts)
    assert any("Track: " in p for p in prompts)
    every = SFTModule(policy={"model_name_or_path": str(tiny_model_dir)}, caption_frac=1.0).examples
    images = ToySceneDataset("train_nt", 40, seed=0, size=112)
    none = next(images[i] for i in range(40) if not images[i].boxes)  # a no-target image query: never captioned
    assert every.is_caption(images[0] if images[0].boxes else images[1]) and not every.is_caption(none)
    assert all(every.is_caption(c) for c in clips)  # clips: by id, whatever their target (clip_example checks it)
    with pytest.raises(ValueError, match="video_spaces"):
        SFTModule(video_spaces=["box"])
    with pytest.raises(ValueError, match="video_templates needs a prompt template for 'anchor'"):
        SFTModule(video_templates={"interval": "toy_temporal"})


def test_batches_are_all_images_or_all_clips(tiny_model_dir, clips):
    images = ToySceneDataset("train", 6, seed=0, size=112)
    mixed = MixedBatches(images, clips, 2, 3, frac=0.4, seed=0)
    kinds = [mixed.is_clip_batch(j) for j in range(200)]
    assert sum(kinds) == 80 and kinds == [
        MixedBatches(images, clips, 2, 3, 0.4, 0).is_clip_batch(j) for j in range(200)
    ]
    assert all(sum(kinds[j : j + 5]) == 2 for j in range(0, 195))  # spread evenly: 2 of any 5
    assert MixedBatches(images, clips, 2, 3, 0.4, seed=1).phase != mixed.phase
    for j in range(6):
        batch = mixed[j]
        assert len(batch) == (3 if kinds[j] else 2)
        assert all(hasattr(s, "clip") == kinds[j] for s in batch)
    m = SFTModule(policy={"model_name_or_path": str(tiny_model_dir)})
    m.policy, m.processor = load_policy(str(tiny_model_dir), dtype="fp32")
    with pytest.raises(ValueError, match="images or clips, not both"):
        m.encode([images[0], clips[0]])
    enc = m.encode(clips[:3])
    assert {"pixel_values_videos", "video_grid_thw", "second_per_grid_ts"} <= set(enc)
    assert (enc["mm_token_type_ids"] == 2 * (enc["input_ids"] == m.policy.config.video_token_id)).all()
    labels = enc.pop("labels")
    for i, c in enumerate(clips[:3]):
        target = m.processor.tokenizer.decode(labels[i][labels[i] != -100])
        assert target == m.examples.clip_example(m.processor, c)[1] + "<|im_end|>"
    assert m.policy(**enc, use_cache=False).logits.shape[:2] == enc["input_ids"].shape


class _Losses(L.Callback):
    def __init__(self):
        self.losses, self.kinds = [], []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.kinds.append(hasattr(batch["samples"][0], "clip"))


def test_clip_fit_steps_lower_the_loss_and_log_the_clip_metrics(tiny_model_dir, tmp_path):
    """The stage's config on the tiny model, clips only (the same two clips every step: an overfit check), then a
    validation on two val clips that logs both spaces' grounding and cycle metrics, then the export."""
    video = {"frac": 1.0, "train": 2, "val": 2, "seed": 0}
    cli = cli_main(
        [
            "--config",
            str(CONFIGS / "toy_sft.yaml"),
            "--config",
            str(CONFIGS / "toy_sft_stage_cycle_video.yaml"),
            "--model.init_args.policy.model_name_or_path",
            str(tiny_model_dir),
            "--model.init_args.export_dir",
            str(tmp_path / "export"),
            "--model.init_args.eval_max_new_tokens",
            "8",
            "--model.init_args.warmup_ratio",
            "0.0",
            "--model.init_args.cosine_decay",
            "false",
            "--model.init_args.optimizer.init_args.lr",
            "3e-3",
            "--data.init_args.data_root",
            str(tmp_path / "data"),
            "--data.init_args.toy",
            json.dumps({"splits": {"train": 2, "val": 1}, "seed": 0, "size": 112, "render_train": True}),
            "--data.init_args.val_files",
            json.dumps({"toy_val": "val.jsonl"}),
            "--data.init_args.video",
            json.dumps(video),
            "--data.init_args.batch_size",
            "2",
            "--data.init_args.num_workers",
            "0",
            "--trainer.max_steps",
            "6",
            "--trainer.max_epochs",
            "6",
            "--trainer.val_check_interval",
            "1.0",
            "--trainer.check_val_every_n_epoch",
            "6",
            "--trainer.enable_progress_bar",
            "false",
            "--trainer.default_root_dir",
            str(tmp_path / "run"),
        ],
        run=False,
    )
    losses = _Losses()
    cli.trainer.callbacks.append(losses)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    assert losses.kinds == [True] * 6
    assert all(b < a for a, b in zip(losses.losses, losses.losses[1:])), losses.losses  # 5.8 -> 4.5 here
    assert losses.losses[-1] < 0.85 * losses.losses[0], losses.losses
    logged = cli.trainer.callback_metrics
    for key in (
        "interval/tiou",
        "interval/r1@0.5",
        "interval/t_acc",
        "interval/cycle_acc50",
        "anchor/st",
        "anchor/when",
        "anchor/where",
        "anchor/cycle_acc50",
        "interval/locatability",
        "anchor/locatability",  # CycleGRPO's own clip validation (evaluate_clips), both spaces
    ):
        assert f"val/toy_video_val/{key}" in logged, sorted(logged)
    assert "val/toy_val/acc50" in logged  # the image sets keep their metrics
    assert all(0.0 <= float(v) <= 1.0 for k, v in logged.items() if k.startswith("val/toy_video_val/"))
    assert (tmp_path / "export" / "config.json").is_file()
    assert torch.isfinite(torch.tensor(losses.losses)).all()
