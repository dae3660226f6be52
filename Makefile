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
# bf16 on a GPU (stages 1-2: ~12 min on one H200), fp32 on a CPU (stage 3: 21 min on 2 cores).
TOY_PRECISION = $(shell $(PY) -c "import torch; print('bf16-mixed' if torch.cuda.is_available() else '32-true')")
toy-model: setup
	$(PY) train.py fit --config configs/toy_sft.yaml --trainer.precision $(TOY_PRECISION)
	$(PY) train.py fit --config configs/toy_sft.yaml --config configs/toy_sft_stage2.yaml --trainer.precision $(TOY_PRECISION)
	$(PY) train.py fit --config configs/toy_sft.yaml --config configs/toy_sft_stage3.yaml --trainer.precision $(TOY_PRECISION)

lint:
	ruff check . && ruff format --check .

.PHONY: setup train test lint toy-model
