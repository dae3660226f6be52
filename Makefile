# The README's two commands. `make train` sets up and runs the embedded default; `make test` sets up and runs the tests.
PY ?= python3
PIP_TORCH = torch==2.14.1 torchvision==0.29.1

setup:
	$(PY) -m pip install -q $(PIP_TORCH) -e ".[dev]"

train: setup
	$(PY) train.py fit --config configs/tiny.yaml

test: setup
	$(PY) -m pytest -q

# Rebuild the embedded toy checkpoint (checkpoints/toy-qwen2.5-vl) from scratch: three SFT stages (docs/toy_model.md),
# bf16 on a GPU (one H200: 4.8 + 3.1 + 7.7 min), fp32 on a CPU (2 cores: stage 3 42-48 min, stages 1-2 hours).
# Deterministic at the seed on a given device and precision: stages 1-2 on an H200 then 3 on a CPU give the committed
# checkpoint bit for bit; all three on an H200 a comparable one (docs/toy_model.md, "The rebuild, verified").
TOY_PRECISION = $(shell $(PY) -c "import torch; print('bf16-mixed' if torch.cuda.is_available() else '32-true')")
toy-model: setup
	$(PY) train.py fit --config configs/toy_sft.yaml --trainer.precision $(TOY_PRECISION)
	$(PY) train.py fit --config configs/toy_sft.yaml --config configs/toy_sft_stage2.yaml --trainer.precision $(TOY_PRECISION)
	$(PY) train.py fit --config configs/toy_sft.yaml --config configs/toy_sft_stage3.yaml --trainer.precision $(TOY_PRECISION)

lint:
	ruff check . && ruff format --check .

.PHONY: setup train test lint toy-model

# The end-to-end GPU harness (one H200; docs/performance.md): the paper's one-GPU configs through train.py on
# random-weight Qwen2.5-VL-3B + SDXL, TRL on the same work, engine parity. On the GPU machine: make gpu-e2e PY=python3
gpu-e2e:
	$(PY) bench/e2e_gpu.py --runs rec_3b_1gpu:off,rec_3b_1gpu:async,rec_3b_1gpu:sync --train-samples 40 --parity --trl \
		--out bench/results/e2e_gpu_h200.json

.PHONY: gpu-e2e
