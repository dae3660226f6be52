"""A CUDA out-of-memory error during fit ends with one line (exit 5) that names the config's measured peak, the card's
memory and the settings that lower the peak, with their flags and current values."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from jsonargparse import Namespace
from test_checkpoints import _args  # the tiny config's fit (tests/cli is on sys.path under pytest)

from cli.main import EXIT_CODES, main
from cli.oom import card_memory, oom_line
from lightning_modules.grpo import GRPOModule


def _oom(*a, **k):
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of ...")


def test_oom_in_a_training_step_is_one_line_with_the_measured_peak_and_the_settings(
    tiny_model_dir, rec_dir, tmp_path, capsys, monkeypatch
):
    monkeypatch.setattr(GRPOModule, "_optimizer_step", _oom)  # inside training_step, after the backward
    measured = json.dumps({"card": "H200", "peak_gib": 111, "s_per_step": 13.9})
    with pytest.raises(SystemExit) as e:
        main(_args(tiny_model_dir, rec_dir, tmp_path / "run", "--trainer.max_steps", "1", "--measured", measured))
    assert e.value.code == EXIT_CODES["memory"] == 5
    err = capsys.readouterr().err.strip().splitlines()
    assert len([x for x in err if x.startswith("error: ")]) == 1 and "Traceback" not in "\n".join(err)
    line = err[-1]
    assert line.startswith("error: CUDA out of memory during fit on no CUDA device visible; ")
    assert "measured at a peak of 111.0 GiB on H200 (--measured)" in line
    assert "--model.init_args.engines.micro_batch_size 6 (now 12; activations)" in line  # tiny.yaml's 12
    assert "--model.init_args.optimisation.offload moments or masters (now none;" in line
    assert "--model.init_args.engines.vision_checkpointing true (now false;" in line
    assert "--model.init_args.policy.gradient_checkpointing true (now false)" in line
    assert line.endswith("(--debug shows the traceback)")


def test_the_line_names_the_card_and_what_is_left_to_lower(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    props = SimpleNamespace(name="NVIDIA H100 80GB HBM3", total_memory=int(79.19 * 2**30))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: props)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: 78 * 2**30)
    assert card_memory() == "NVIDIA H100 80GB HBM3 with 79.2 GiB (peak allocated 78.0 GiB)"
    engines = Namespace(micro_batch_size=1, vision_checkpointing=True)
    optimisation = Namespace(offload="moments", master_weights="fp32")
    policy = Namespace(gradient_checkpointing=True)
    cfg = Namespace(
        measured=None,
        model=Namespace(init_args=Namespace(engines=engines, optimisation=optimisation, policy=policy)),
    )
    line = oom_line(cfg, "fit")
    assert line.startswith("CUDA out of memory during fit on NVIDIA H100 80GB HBM3 with 79.2 GiB")
    assert "states no measured peak (--measured.peak_gib)" in line
    assert "optimisation.offload masters (now moments;" in line  # the one setting left
    assert "micro_batch_size" not in line and "checkpointing" not in line


def test_under_fsdp2_the_line_names_the_reference_offload_not_the_optimizer_offload_it_refuses():
    """One H100, 2026-12-07: fsdp2's OOM line named ``optimisation.offload``, which fsdp2 refuses (its shards are the
    fp32 masters); the settings that work there are the reference's shards in host memory and more ranks."""
    engines = Namespace(micro_batch_size=2, vision_checkpointing=None)
    optimisation = Namespace(offload="none", master_weights="fp32")
    model = Namespace(engines=engines, optimisation=optimisation, policy=Namespace(gradient_checkpointing=True))
    model.kl = Namespace(reference_offload=False)
    cfg = Namespace(measured=None, trainer=Namespace(strategy="fsdp2", devices=1), model=Namespace(init_args=model))
    line = oom_line(cfg, "fit", card="NVIDIA H100 80GB HBM3 with 79.2 GiB (peak allocated 77.8 GiB)")
    assert "optimisation.offload" not in line
    assert "--model.init_args.kl.reference_offload true (now false;" in line
    assert "--trainer.devices (now 1;" in line and "micro_batch_size 1 (now 2;" in line
    cfg.trainer.strategy = "auto"  # one process: the optimizer offload is the lever again
    assert "optimisation.offload moments or masters (now none;" in oom_line(cfg, "fit", card="x")
