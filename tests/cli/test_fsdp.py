"""Several CPU processes (gloo) with the real Qwen2.5-VL classes (a tiny model built from config).

One optimizer step at the same global batch with fixed (teacher-forced) completions gives the same weights on two
processes as on one, under DDP and under FSDP2 (``--trainer.strategy fsdp2``, with per-layer gradient checkpointing),
in fp32 (tests/fsdp_probe.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
ACCELERATOR = os.environ.get("FSDP_TEST_ACCELERATOR", "cpu")
"""``gpu`` runs these tests on 2 GPUs (NCCL), for a machine that has them; by default 2 CPU processes (gloo)."""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "tests"), str(REPO)]), "OMP_NUM_THREADS": "1"}


def _step(model: Path, data: Path, out: Path, *extra: str) -> dict[str, torch.Tensor]:
    cmd = [sys.executable, str(REPO / "tests/fsdp_probe.py"), "--model", str(model), "--data", str(data)]
    cmd += ["--out", str(out), "--accelerator", ACCELERATOR, *extra]
    proc = subprocess.run(cmd, cwd=out.parent, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(out.with_suffix(".json").read_text())["global_step"] == 1
    return torch.load(out)


def _rel(x: dict[str, torch.Tensor], y: dict[str, torch.Tensor]) -> float:
    """||x - y|| / ||y|| over every tensor of the state dict."""
    num = sum(float(((x[k] - y[k]) ** 2).sum()) for k in y)
    return math.sqrt(num / sum(float((y[k] ** 2).sum()) for k in y))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_one_step_on_two_processes_matches_one(tiny_model_dir, rec_dir, tmp_path):
    from transformers import AutoModelForImageTextToText

    before = AutoModelForImageTextToText.from_pretrained(tiny_model_dir).state_dict()
    one = _step(tiny_model_dir, rec_dir, tmp_path / "one.pt")
    update = {k: one[k] - before[k] for k in one}
    assert _rel(one, before) > 1e-3, "the step did not move the weights: nothing is compared"
    for strategy, extra in (("ddp", []), ("fsdp2", ["--gradient_checkpointing"])):
        two = _step(
            tiny_model_dir, rec_dir, tmp_path / f"{strategy}.pt", "--devices", "2", "--strategy", strategy, *extra
        )
        assert sorted(two) == sorted(one)
        assert _rel(two, one) < 1e-5, strategy
        # stronger than the weights: the update itself (SGD: the clipped gradient), measured ~3e-7 on CPU
        assert _rel({k: two[k] - before[k] for k in two}, update) < 1e-5, strategy


def _fit(args: list[str], cwd: Path) -> None:
    cmd = [sys.executable, str(REPO / "train.py"), *args]
    proc = subprocess.run(cmd, cwd=cwd, env=_env(), capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_sharded_checkpoint_resumes_and_exports(tiny_model_dir, rec_dir, tmp_path):
    """FSDP2 on 2 processes (bf16 compute, fp32 masters, CPU-offloaded reference, frozen vision tower): the distributed
    checkpoint of epoch 0 resumes with the same step, pool and smoother on every rank and runs on; ``train.py export``
    writes the full policy of the sharded checkpoint as an HF directory (~60 s on 2 shared CPU cores)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForImageTextToText

    offline = rec_dir / "offline.jsonl"
    offline.write_text(
        "".join(json.dumps({"sample_id": f"s{i}", "description": "a striped blue background"}) + "\n" for i in range(8))
    )
    synthesis = {
        "class_path": "callbacks.synthesis.SynthesisCallback",
        "init_args": {
            "mode": "sync",
            "offline_descriptions": str(offline),
            "poll_interval": 0.05,
            "gallery_samples": 0,
        },
    }
    model_data = [
        "--config", str(REPO / "configs/tiny.yaml"),
        "--trainer.accelerator", ACCELERATOR,
        "--model.init_args.policy.model_name_or_path", str(tiny_model_dir),
        "--model.init_args.policy.dtype", "bf16",
        "--data.init_args.data_root", str(rec_dir),
        "--data.init_args.toy", "null",
        "--data.init_args.train_files", "[train.jsonl]",
        "--data.init_args.val_files", "{}",
    ]  # fmt: skip
    run = tmp_path / "run"

    def fit(epochs: int, probe: str, *extra: str) -> None:
        rank_probe = {"class_path": "ddp_probe.RankProbe", "init_args": {"out_dir": str(tmp_path / probe)}}
        _fit(
            ["fit", *model_data,
             "--trainer.devices", "2", "--trainer.strategy", "fsdp2", "--trainer.precision", "32-true",
             "--trainer.max_epochs", str(epochs), "--trainer.logger", "false", "--trainer.enable_progress_bar", "false",
             "--trainer.limit_val_batches", "0", "--trainer.default_root_dir", str(run),
             "--callbacks.synthesis", json.dumps(synthesis), "--callbacks.probe", json.dumps(rank_probe),
             "--callbacks.gallery", "null", "--callbacks.completions", "null",
             "--model.init_args.sampling.max_new_tokens", "4", "--model.init_args.sampling.group_size", "2",
             "--model.init_args.kl.reference_offload", "true", "--model.init_args.policy.freeze_vision", "true",
             "--data.init_args.batch_size", "2", *extra],
            tmp_path,
        )  # fmt: skip

    fit(1, "first")
    ckpt = run / "checkpoints/last.ckpt"
    assert (ckpt / "meta.pt").is_file() and len(list(ckpt.glob("*.distcp"))) == 2  # one shard file per rank
    # each rank checksummed its share of the files; rank 0 wrote them all (core/checkpoint_files.py)
    from core.checkpoint_files import MANIFEST, damage

    listed = sorted(json.loads((ckpt / MANIFEST).read_text())["files"])
    assert listed == [".metadata", "__0_0.distcp", "__1_0.distcp", "meta.pt"] and damage(ckpt) is None
    saved = tmp_path / "epoch0.ckpt"
    ckpt.rename(saved)
    # resumed with rollouts on the shards (each layer gathered per decode step, the ranks in lockstep)
    fit(2, "resumed", "--ckpt_path", str(saved), "--model.init_args.engines.rollout_gather", "per_layer")
    for r in (0, 1):
        before = json.loads((tmp_path / f"first/rank{r}.json").read_text())
        after = json.loads((tmp_path / f"resumed/start_rank{r}.json").read_text())
        end = json.loads((tmp_path / f"resumed/rank{r}.json").read_text())
        assert after["global_step"] == before["global_step"] == 2 and end["global_step"] == 4
        assert after["lineage"] == before["lineage"] and after["smoother"] == before["smoother"], f"rank {r}"
        assert all(len(v) == 3 for v in end["lineage"].values())  # original, epoch 1, epoch 2 (sync mode)
    ends = [json.loads((tmp_path / f"resumed/rank{r}.json").read_text()) for r in (0, 1)]
    assert ends[0]["lineage"] == ends[1]["lineage"] and ends[0]["smoother"] == ends[1]["smoother"]

    out = tmp_path / "export"
    _fit(
        ["export", *model_data, "--model.init_args.policy.dtype", "fp32", "--ckpt_path", str(saved), "--out", str(out)],
        tmp_path,
    )
    dcp_to_torch_save(saved, tmp_path / "full.pt")
    masters = {k[len("policy.") :]: v for k, v in torch.load(tmp_path / "full.pt")["state_dict"].items()}
    exported = AutoModelForImageTextToText.from_pretrained(out).state_dict()
    initial = AutoModelForImageTextToText.from_pretrained(tiny_model_dir).state_dict()
    assert sorted(exported) == sorted(masters)
    assert all(torch.equal(exported[k], masters[k]) for k in exported)
    moved = [k for k in exported if "visual" not in k and not torch.equal(exported[k], initial[k])]
    frozen = [k for k in exported if "visual" in k and not torch.equal(exported[k], initial[k])]
    assert moved and not frozen, (len(moved), frozen[:3])


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_rec_7b_layout_on_four_cpu_processes(tmp_path):
    """configs/rec_7b.yaml's layout (4 training processes under FSDP2, the data server apart) on CPU with gloo and the
    toy checkpoint: the config composed and swapped exactly as tests/cli/test_config_runs.py does, then 4 processes
    instead of one. Every rank ends on the same pool and smoother; the checkpoint holds one shard per rank."""
    import yaml
    from test_config_runs import CONFIGS, compose, cpu_swap

    from datamodules.toy import export_jsonl, export_offline_descriptions

    root = tmp_path / "toy_rec"
    export_jsonl(root, "train", 8, seed=0, task="rec")
    export_jsonl(root, "val", 4, seed=0, task="rec")
    export_offline_descriptions(root, "train", task="rec")
    cfg = cpu_swap(compose((CONFIGS / "rec_7b.yaml",)), {"rec": root}, tmp_path)
    assert cfg["trainer"]["strategy"] == "fsdp2"
    cfg["trainer"]["devices"] = 4
    cfg["trainer"]["logger"] = False
    cfg["data"]["init_args"].update(batch_size=1, max_train_samples=8)  # 4 processes x 1 prompt: 2 steps per epoch
    cfg["callbacks"]["probe"] = {"class_path": "ddp_probe.RankProbe", "init_args": {"out_dir": str(tmp_path / "probe")}}
    cfg["callbacks"]["completions"] = None  # a W&B table: nothing to check here
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    _fit(["fit", "--config", str(path)], tmp_path)
    ranks = [json.loads((tmp_path / f"probe/rank{r}.json").read_text()) for r in range(4)]
    assert [r["world_size"] for r in ranks] == [4] * 4 and {r["global_step"] for r in ranks} == {4}
    assert all(r["lineage"] == ranks[0]["lineage"] and r["smoother"] == ranks[0]["smoother"] for r in ranks)
    assert sum(len(v) > 1 for v in ranks[0]["lineage"].values()) > 0  # the server's images were swapped in
    ckpt = Path(cfg["trainer"]["default_root_dir"]) / "checkpoints/last.ckpt"
    assert len(list(ckpt.glob("*.distcp"))) == 4
