"""Every training config parses (``--print_config``) and the CPU ones instantiate without loading weights."""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import yaml

from core.config_files import load_config
from train import cli_main

REPO = Path(__file__).resolve().parents[2]
TRAIN_CONFIGS = sorted(
    p
    for p in (REPO / "configs").rglob("*.yaml")
    if p.parent.name not in ("synth", "sweeps", "baselines", "study", "overlays", "coevolve")  # study/: study files
    and "parts" not in p.relative_to(REPO / "configs").parts  # parts/: what configs compose (test_config_compose.py)
    and "_stage" not in p.stem
)
TOY_STAGES = sorted((REPO / "configs").glob("toy_sft_stage[0-9]*.yaml"))
"""The numbered stages of ``make toy-model``; ``toy_sft_stage_evolved.yaml`` continues the finished checkpoint."""
BASELINES = sorted((REPO / "configs/baselines").glob("*.yaml"))
BASES = [REPO / "configs" / n for n in ("tiny.yaml", "rec_3b.yaml", "rec_7b.yaml")]
ENGINE_OVERLAYS = [REPO / "configs/overlays/vllm.yaml"]
EVOLVED_BASES = [REPO / "configs" / n for n in ("evolved_tiny.yaml", "evolved_3b.yaml")]


@pytest.mark.parametrize("path", TRAIN_CONFIGS, ids=lambda p: str(p.relative_to(REPO / "configs")))
def test_config_parses_with_print_config(path):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--config", str(path), "--print_config"])
    assert exc.value.code in (None, 0)
    printed = yaml.safe_load(buf.getvalue())
    assert printed["model"]["class_path"].startswith("lightning_modules.")
    assert printed["data"]["class_path"].startswith("datamodules.")


@pytest.mark.parametrize(
    "path", [p for p in TRAIN_CONFIGS if load_config(p)["trainer"].get("accelerator") == "cpu"], ids=lambda p: p.name
)
def test_cpu_config_instantiates_without_loading_weights(path):
    args = ["--config", str(path)]
    if "checkpoints/toy-qwen2.5-vl-math" in json.dumps(load_config(path)):  # built by `make toy-model-math`
        args += ["--model.init_args.policy.model_name_or_path", "checkpoints/toy-qwen2.5-vl"]
    cli = cli_main(args, run=False)
    assert getattr(cli.model, "policy", None) is None  # weights load in configure_model(), not __init__


def test_every_config_is_listed():
    names = {p.relative_to(REPO / "configs").as_posix() for p in TRAIN_CONFIGS}
    assert {"tiny.yaml", "rec_3b.yaml", "rec_7b.yaml", "ovd_3b.yaml", "toy_sft.yaml"} <= names


@pytest.mark.parametrize("stage", TOY_STAGES, ids=lambda p: p.stem)
def test_toy_sft_stages_continue_the_previous_one(stage):
    """``make toy-model``: each later stage stacks on toy_sft.yaml and loads what the stage before exported."""
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--config", str(REPO / "configs/toy_sft.yaml"), "--config", str(stage), "--print_config"])
    assert exc.value.code in (None, 0)
    args = yaml.safe_load(buf.getvalue())["model"]["init_args"]
    n = int(stage.stem.rsplit("stage", 1)[1])
    assert args["build_tiny"] is None and args["policy"]["model_name_or_path"] == f"outputs/toy_sft/stage{n - 1}"
    last = n == len(TOY_STAGES) + 1
    assert args["export_dir"] == ("checkpoints/toy-qwen2.5-vl" if last else f"outputs/toy_sft/stage{n}")


def test_the_evolved_sft_stage_continues_the_toy_checkpoint():
    """``make toy-model-evolved``: the step-format stage starts from the committed checkpoint and writes its own."""
    buf = io.StringIO()
    stage = REPO / "configs/toy_sft_stage_evolved.yaml"
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        cli_main(["fit", "--config", str(REPO / "configs/toy_sft.yaml"), "--config", str(stage), "--print_config"])
    cfg = yaml.safe_load(buf.getvalue())
    args = cfg["model"]["init_args"]
    assert args["policy"]["model_name_or_path"] == "checkpoints/toy-qwen2.5-vl" and args["build_tiny"] is None
    assert args["export_dir"] == "checkpoints/toy-qwen2.5-vl-evolved" and args["target"] == "toy_steps"
    assert cfg["data"]["init_args"]["toy"]["evolve"] > 0


@pytest.mark.parametrize("base", EVOLVED_BASES, ids=lambda p: p.stem)
def test_the_evolved_syn_overlay_puts_both_evolutions_on_one_pool(base):
    buf = io.StringIO()
    overlay = REPO / "configs/overlays/evolved_syn.yaml"
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        cli_main(["fit", "--config", str(base), "--config", str(overlay), "--print_config"])
    cfg = yaml.safe_load(buf.getvalue())
    synth = cfg["callbacks"]["synthesis"]["init_args"]
    assert synth["strategy"] == "instruction_and_image_evolution" and synth["source"] == "original"
    method = cfg["model"]["init_args"]["method"]
    assert (
        method["class_path"] == "lightning_modules.methods.evolved_grpo.EvolvedSynGRPO"
        and cfg["method"] == "evolved_syn"
    )
    assert method["init_args"]["process_weight"] == 0.5  # the base's method arguments carry over to the new class
    assert cfg["callbacks"]["metrics"] is not None  # the base's other callbacks stay


@pytest.mark.parametrize("base", BASES, ids=lambda p: p.stem)
@pytest.mark.parametrize("overlay", BASELINES, ids=lambda p: p.stem)
def test_baseline_overlays_compose_with_every_base(base, overlay):
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit) as exc:
        cli_main(["fit", "--config", str(base), "--config", str(overlay), "--print_config"])
    assert exc.value.code in (None, 0)
    cfg = yaml.safe_load(buf.getvalue())
    args = cfg["model"]["init_args"]
    if overlay.stem == "sft":
        assert cfg["model"]["class_path"] == "lightning_modules.sft.SFTModule" and args["target"] == "answer"
        assert cfg["callbacks"]["synthesis"] is None and cfg["callbacks"]["metrics"] is not None
        return
    named = cfg["callbacks"]
    # an overlay patches single callbacks: the rest of the base's stay, and the run is named after its method
    assert cfg["method"] == overlay.stem and named["metrics"]["class_path"].endswith("MetricsJSONL")
    assert named["checkpoint"]["init_args"]["every_n_epochs"] in (None, 1) and named["results"] is not None
    synth = named["synthesis"]
    if overlay.stem.startswith("grpo"):
        assert args["method"]["class_path"] == "lightning_modules.methods.grpo.GRPO"  # the plain GRPO plug-in
        assert synth["init_args"]["mode"] == "off"
        assert named["checkpoint"]["init_args"]["save_last"] is True  # the base's setting survives the patch
    if overlay.stem == "offline_generation":
        assert synth["init_args"]["offline_descriptions"] and synth["init_args"]["source"] == "original"
    if overlay.stem == "syn_grpo_wo_rdiv":
        method = args["method"]["init_args"]
        assert method["description_selection"] == "random" and method["diversity_weight"] == 0.0


def test_baselines_cover_every_method_row_of_table_1():
    assert {p.stem for p in BASELINES} == {
        "grpo",
        "grpo_entropy_loss",
        "grpo_entropy_adv",
        "offline_generation",
        "syn_grpo_wo_rdiv",
        "sft",
    }


@pytest.mark.parametrize(
    "base", sorted(p for p in (REPO / "configs").glob("*.yaml") if "_stage" not in p.stem), ids=lambda p: p.stem
)
@pytest.mark.parametrize("overlay", ENGINE_OVERLAYS, ids=lambda p: p.stem)
def test_engine_overlays_change_only_the_rollout_engine(base, overlay):
    """configs/overlays/vllm.yaml switches the rollout engine of any GRPO config and changes no other line."""

    def printed(*paths):
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
            cli_main(["fit", *[a for p in paths for a in ("--config", str(p))], "--print_config"])
        return yaml.safe_load(buf.getvalue())

    plain = printed(base)
    if not plain["model"]["class_path"].endswith("GRPOModule"):
        pytest.skip("not a GRPO config")
    with_overlay = printed(base, overlay)
    m, p = with_overlay["model"]["init_args"], plain["model"]["init_args"]
    assert {k for k in set(m) | set(p) if m.get(k) != p.get(k)} == {"engines"}
    m, p = m["engines"], p["engines"]
    assert {k for k in set(m) | set(p) if m.get(k) != p.get(k)} == {"rollout_engine", "rollout_args"}
    assert {k: v for k, v in with_overlay.items() if k != "model"} == {k: v for k, v in plain.items() if k != "model"}
