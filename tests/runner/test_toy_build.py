"""runner.toy_build: the toy base's stages run in order, a built stage is skipped, a stopped one continues from its
newest checkpoint (real train.py fits at toy sizes)."""

import json
import subprocess
import sys

import pytest

from runner import toy_build


def test_a_stopped_stage_continues_and_a_built_stage_is_skipped(tmp_path, monkeypatch):
    monkeypatch.setattr(toy_build, "ROOT", tmp_path)
    stage = toy_build.Stage("base1", "configs/toy_sft_stage_base.yaml", "models/stage1")
    (tmp_path / "models/stage1").mkdir(parents=True)
    assert not toy_build.is_built(stage)
    assert "--ckpt_path" not in toy_build.command(stage, "32-true", [])
    last = stage.run_dir / "checkpoints" / "last.ckpt"
    last.parent.mkdir(parents=True)
    last.write_bytes(b"")
    cmd = toy_build.command(stage, "32-true", ["--trainer.max_steps", "2"])
    assert cmd[cmd.index("--ckpt_path") + 1] == "outputs/toy_sft-base1/checkpoints/last.ckpt"
    assert cmd[-2:] == ["--trainer.max_steps", "2"]
    toy_build.record_path(stage).write_text(json.dumps({"configs": list(stage.configs)}))
    assert toy_build.is_built(stage) and "--ckpt_path" not in toy_build.command(stage, "32-true", [])
    assert toy_build.build([stage], "32-true", []) == 0  # nothing to do: no fit is started
    toy_build.record_path(stage).write_text(json.dumps({"configs": ["other.yaml"]}))
    assert not toy_build.is_built(stage)


@pytest.mark.slow  # a real stage-1 fit from scratch (~15 s); the resumable build's logic runs by default above
def test_stage_one_fits_from_scratch_and_is_recorded(tmp_path):
    """The first stage's real fit (tiny: 2 steps of 2), its export and BUILD record, through the command a user runs."""
    flags = [
        "--trainer.max_steps", "2", "--trainer.val_check_interval", "2", "--data.init_args.batch_size", "2",
        "--data.init_args.num_workers", "0", "--data.init_args.max_eval_samples", "2",
        "--data.init_args.data_root", str(tmp_path / "data"),
        "--model.init_args.build_tiny.corpus_samples", "200",
        "--model.init_args.policy.model_name_or_path", str(tmp_path / "init"),
        "--model.init_args.export_dir", str(tmp_path / "stage1"),
        "--trainer.default_root_dir", str(tmp_path / "run"),
    ]  # fmt: skip
    code = (
        "import sys; from runner import toy_build as t; "
        f"t.STAGES = (t.Stage('stage1', 'configs/toy_sft_stage_base.yaml', {str(tmp_path / 'stage1')!r}),); "
        "sys.exit(t.main(['--precision', '32-true', '--only', 'stage1', '--'] + sys.argv[1:]))"
    )
    out = subprocess.run([sys.executable, "-c", code, *flags], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert (tmp_path / "stage1" / "config.json").is_file()
    record = json.loads((tmp_path / "stage1" / "BUILD").read_text())
    assert record["configs"] == ["configs/toy_sft.yaml", "configs/toy_sft_stage_base.yaml"]
    assert record["precision"] == "32-true"
