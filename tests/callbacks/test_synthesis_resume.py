"""The self-evolving loop under faults (issue #13): exact mid-epoch resume, kills of the server and a worker while the
tiny run trains, descriptions over the API's limit. Real tiny runs through ``train.py``'s CLI and a real local data
server with the (deterministic) procedural painter; ``sync`` synthesis, so timing cannot decide which images swap.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import signal
from pathlib import Path

import lightning as L
import pytest
import torch
from conftest import write_rec_jsonl

from callbacks import synthesis_server
from core.records import DataError
from datamodules.resumable import EpochSampler, ResumableLoader
from runner.runs import read_metrics_jsonl
from synth.client import AsyncSubmitter
from train import cli_main

REPO = Path(__file__).resolve().parents[2]
TIMING = {"time", "elapsed", "synth/queue_depth", "synth/lag_s", "train/peak_mem_gib"}  # and train/time/*
"""Columns that measure time or depend on it (how far the server got when a step ended); all others must match."""
N_SAMPLES, BATCH = 12, 4  # 3 steps per epoch
DESCRIPTIONS = (
    "a striped blue background with many small green triangles",
    "a checkered yellow background with some large pink stars",
)


# --- the sampler on its own --------------------------------------------------------------------------------------


def test_epoch_sampler_order_depends_only_on_seed_and_epoch():
    a, b = EpochSampler(10, seed=3), EpochSampler(10, seed=3)
    torch.manual_seed(0)
    first = a.order(1)
    torch.rand(100)  # the global RNG moves: the order does not
    assert b.order(1) == first and sorted(first) == list(range(10)) and a.order(2) != first
    assert EpochSampler(10, shuffle=False).order(5) == list(range(10))
    ranks = [EpochSampler(10, seed=3, num_replicas=3, rank=r).order(1) for r in range(3)]
    assert [len(r) for r in ranks] == [4, 4, 4] and set(sum(ranks, [])) == set(range(10))  # padded like DDP


def test_loader_resumes_after_the_batches_it_handed_out_and_refuses_other_settings():
    data = list(range(10))
    loader = ResumableLoader(data, batch_size=3, sampler=EpochSampler(10, seed=1))
    loader.sampler.set_epoch(2)
    full = [b.tolist() for b in loader]
    it = iter(loader)
    seen = [next(it).tolist(), next(it).tolist()]
    state = json.loads(json.dumps(loader.state_dict()))
    assert state["epoch"] == 2 and state["batches"] == 2 and seen == full[:2]
    fresh = ResumableLoader(data, batch_size=3, sampler=EpochSampler(10, seed=1))
    fresh.load_state_dict(state)
    fresh.sampler.set_epoch(2)
    assert [b.tolist() for b in fresh] == full[2:] and len(fresh) == len(full) == 4
    assert fresh.state_dict()["batches"] == 4
    assert [b.tolist() for b in fresh] == full  # the skip applies once
    torch.manual_seed(0)
    before = torch.rand(1)
    torch.manual_seed(0)
    list(iter(ResumableLoader(data, batch_size=3, sampler=EpochSampler(10))))
    assert torch.rand(1) == before  # building and running the iterator draws nothing from the global RNG
    with pytest.raises(DataError, match="batch_size: checkpoint 3, now 5.*--data.batch_size"):
        ResumableLoader(data, batch_size=5, sampler=EpochSampler(10, seed=1)).load_state_dict(state)


# --- tiny runs -------------------------------------------------------------------------------------------------------


class Killed(Exception):
    pass


class _Stop(L.Callback):
    """Ends the process's training abruptly after ``step`` (an exception: nothing after it runs, like a kill)."""

    def __init__(self, step: int):
        self.step = step

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            raise Killed(f"killed after step {self.step}")


class _Faults(L.Callback):
    """Kills the local data server's process, or one of its workers, after given steps (SIGKILL)."""

    def __init__(self, kill_server_at: int | None = None, kill_worker_at: int | None = None):
        self.kill_server_at, self.kill_worker_at = kill_server_at, kill_worker_at
        self.killed: list[str] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        synth = next(c for c in trainer.callbacks if type(c).__name__ == "SynthesisCallback")
        if trainer.global_step == self.kill_worker_at:
            with synth.server.local.client() as c:
                pid = c.health().workers[0].pid
            os.kill(pid, signal.SIGKILL)
            self.killed.append(f"worker {pid}")
        if trainer.global_step == self.kill_server_at:
            synth.server.local.proc.kill()
            synth.server.local.proc.wait(10)
            self.killed.append("server")


def _data(root: Path) -> Path:
    write_rec_jsonl(root, N_SAMPLES)
    offline = root / "offline.jsonl"
    offline.write_text(
        "".join(
            json.dumps({"sample_id": f"s{i}", "description": d}) + "\n" for i in range(N_SAMPLES) for d in DESCRIPTIONS
        )
    )
    return root


def _fit(model_dir, data: Path, out: Path, *, epochs: int = 2, ckpt: Path | None = None, extra=(), offline=None):
    callbacks = [
        {
            "class_path": "callbacks.synthesis.SynthesisCallback",
            "init_args": {
                "mode": "sync",
                "offline_descriptions": str(offline or data / "offline.jsonl"),
                "poll_interval": 0.05,
                "gallery_samples": 0,
                "sync_timeout": 120,
            },
        },
        {"class_path": "callbacks.logging.MetricsJSONL", "init_args": {"path": str(out / "metrics.jsonl")}},
        {
            "class_path": "lightning.pytorch.callbacks.ModelCheckpoint",
            "init_args": {"dirpath": str(out / "ckpt"), "every_n_train_steps": 1, "save_top_k": -1},
        },
    ]
    args = [
        "--config",
        str(REPO / "configs/tiny.yaml"),
        "--seed_everything",
        "7",
        "--model.init_args.policy.model_name_or_path",
        str(model_dir),
        "--model.init_args.sampling.max_new_tokens",
        "4",
        "--model.init_args.sampling.group_size",
        "2",
        "--model.init_args.kl.coef",
        "0.0",
        "--data.init_args.data_root",
        str(data),
        "--data.init_args.toy",
        "null",
        "--data.init_args.train_files",
        "[train.jsonl]",
        "--data.init_args.val_files",
        "{}",
        "--data.init_args.batch_size",
        str(BATCH),
        "--trainer.default_root_dir",
        str(out),
        "--trainer.logger",
        "false",
        "--trainer.callbacks",
        json.dumps(callbacks),
        "--trainer.max_epochs",
        str(epochs),
        "--trainer.enable_progress_bar",
        "false",
        "--trainer.limit_val_batches",
        "0",
    ]
    cli = cli_main(args, run=False)
    cli.trainer.callbacks.extend(extra)
    try:
        cli.trainer.fit(cli.model, datamodule=cli.datamodule, ckpt_path=str(ckpt) if ckpt else None)
    except Killed:
        pass
    return cli


def _train_rows(out: Path) -> list[dict]:
    (run,) = read_metrics_jsonl(out / "metrics.jsonl")
    timing = [c for c in run.train.columns if c in TIMING or c.startswith(("train/time/", "synth/wait_s"))]
    rows = run.train.drop(columns=timing).to_dict("records")
    return [{k: v for k, v in r.items() if not (isinstance(v, float) and math.isnan(v))} for r in rows]


def _pool(cli) -> dict[str, list[tuple]]:
    """Each sample's lineage: (version, epoch, description, parent, job id, sha256 of the image)."""
    pool = cli.datamodule.pool
    return {
        sid: [
            (
                v.version,
                v.epoch,
                v.description,
                v.parent,
                v.job_id,
                hashlib.sha256(Path(v.image_path).read_bytes()).hexdigest(),
            )
            for v in pool.lineage(sid)
        ]
        for sid in pool.order
    }


def _orphans(out: Path, cli) -> set[str]:
    used = {Path(v.image_path).name for sid in cli.datamodule.pool.order for v in cli.datamodule.pool.lineage(sid)}
    return {p.name for p in (out / "synth").glob("*.png")} - used


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tmp_path_factory):
    """The uninterrupted run: 2 epochs of 3 steps, a checkpoint after every step."""
    data = _data(tmp_path_factory.mktemp("resume-data"))
    out = tmp_path_factory.mktemp("resume-ref")
    cli = _fit(tiny_model_dir, data, out)
    assert cli.trainer.global_step == 6
    return {"data": data, "out": out, "rows": _train_rows(out), "pool": _pool(cli), "cli": cli}


@pytest.mark.parametrize("resume_step", [4, 3])  # mid-epoch 2; the last batch of epoch 1 (before its boundary swap)
def test_a_killed_run_resumed_from_a_checkpoint_reproduces_the_uninterrupted_run(
    tiny_model_dir, reference, tmp_path, resume_step
):
    out = tmp_path / "run"
    _fit(tiny_model_dir, reference["data"], out, extra=[_Stop(5)])  # killed after step 5
    (ckpt,) = (out / "ckpt").glob(f"*step={resume_step}.ckpt")
    cli = _fit(tiny_model_dir, reference["data"], out, ckpt=ckpt)
    assert cli.trainer.global_step == 6
    rows = _train_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5, 6]
    for got, want in zip(rows, reference["rows"]):
        assert got == want, f"step {want['step']} differs"
    assert _pool(cli) == reference["pool"]  # the same swaps, the same images (sha256), the same lineage
    assert sum(len(v) - 1 for v in reference["pool"].values()) == N_SAMPLES * 2  # every sample swapped at both ends
    assert not _orphans(out, cli), "outputs that no pool version points to"


def test_a_description_over_the_api_limit_is_cut_and_training_goes_on(tiny_model_dir, tmp_path):
    """OVD allows 512 tokens: a policy description over 4,000 characters used to raise a pydantic error inside
    on_train_batch_end and end training."""
    data = _data(tmp_path / "data")
    long_text = "a striped blue background with many small green triangles " * 90  # ~5,300 characters
    offline = tmp_path / "long.jsonl"
    offline.write_text("".join(json.dumps({"sample_id": f"s{i}", "description": long_text}) + "\n" for i in range(4)))
    cli = _fit(tiny_model_dir, data, tmp_path / "run", epochs=1, offline=offline)
    assert cli.trainer.global_step == 3
    synth = next(c for c in cli.trainer.callbacks if type(c).__name__ == "SynthesisCallback")
    assert synth.totals["failed"] == 0 and synth.totals["swapped"] == 4
    for sid in (f"s{i}" for i in range(4)):
        (_, v1) = cli.datamodule.pool.lineage(sid)
        assert v1.description == long_text[:4000]


class _QuickGiveUp(AsyncSubmitter):
    """The callback's submitter with a short retry budget: with the default (20 retries, backoff up to 5 s) step 3's
    ``sync`` wait on a dead server lasts about a minute before its jobs are given up; the path is the same."""

    def __init__(self, client, **kwargs):
        super().__init__(client, **{**kwargs, "max_retries": 5, "backoff": 0.05, "max_backoff": 0.5})


@pytest.mark.slow
def test_server_and_worker_killed_while_training_lose_nothing(tiny_model_dir, reference, tmp_path, monkeypatch):
    """SIGKILL a painter worker after step 1 and the whole data server after step 2 (its jobs of steps 1-2 and the
    ones step 3 sends while it is down are gone with it): the run finishes, the server is restarted at the epoch
    boundary, the outstanding jobs are resubmitted under their ids, and the pool and the per-step metrics are the
    uninterrupted run's (the painter is deterministic)."""
    monkeypatch.setattr(synthesis_server, "AsyncSubmitter", _QuickGiveUp)  # the callback's DataServer makes it
    out = tmp_path / "run"
    faults = _Faults(kill_worker_at=1, kill_server_at=2)
    cli = _fit(tiny_model_dir, reference["data"], out, extra=[faults])
    synth = next(c for c in cli.trainer.callbacks if type(c).__name__ == "SynthesisCallback")
    assert cli.trainer.global_step == 6 and len(faults.killed) == 2
    assert synth.totals["server_restarts"] == 1 and synth.totals["failed"] == 0 and not synth.outstanding
    assert _pool(cli) == reference["pool"]
    assert _train_rows(out) == reference["rows"]
    assert not _orphans(out, cli)
    assert not [p for p in (out / "synth").iterdir() if p.name.endswith(".tmp")]
