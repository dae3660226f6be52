"""The fast rollout engine and the packed update engine against the HF path (``bench/engine_parity.py``).

On the CPU in fp32 the engines must agree to rounding: log-probs of the same teacher-forced completions, the GRPO loss
and its gradient. The GPU variant (``-m gpu``) runs the same check in bf16, where the yardstick is the bf16 noise of
the HF forward against an fp32 copy (docs/performance.md has the 3B figures)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.engine_parity import run_parity  # noqa: E402


def test_engines_agree_with_hf_in_fp32_on_cpu(tiny_model_dir):
    out = run_parity(str(tiny_model_dir), device="cpu", prompts=2, group=3, new_tokens=10, micro_batch=2)
    assert out["dtype"] == "fp32"
    for name, d in out["logprob_abs_diff"].items():
        assert d["max"] < 1e-4, (name, d)
    assert out["loss"]["relative_diff"] < 1e-5, out["loss"]
    assert out["grad_cosine_packed_vs_hf"] > 0.9999
    assert all(out["verdict"].values()), out["verdict"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_engines_agree_with_hf_in_bf16_on_gpu(tiny_model_dir):
    out = run_parity(str(tiny_model_dir), device="cuda")
    assert out["dtype"] == "bf16"
    assert all(out["verdict"].values()), out
