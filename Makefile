# The README's two commands. `make train` sets up and runs the embedded default; `make test` sets up and runs the tests.
PY ?= python3
PIP_TORCH = torch==2.14.1 torchvision==0.29.1

setup:
	$(PY) -m pip install -q $(PIP_TORCH) -e ".[dev]"

train: setup
	$(PY) train.py fit --config configs/tiny.yaml

test: setup
	$(PY) -m pytest -q

lint:
	ruff check . && ruff format --check .

.PHONY: setup train test lint
