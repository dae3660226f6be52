#!/usr/bin/env bash
# Issue 58: RL from the toy base through train.py fit, each run with the held-out summary (the yardstick's greedy
# Acc@0.5 on its fixed 512 val + 512 ood scenes, at the fit's start and end; callbacks/heldout.py). The embedded
# default's settings (configs/tiny.yaml), three methods x three seeds, J fits side by side, one BLAS thread each:
#   syn   Syn-GRPO (configs/tiny.yaml, the toy prompt)                 = make train at seed 0
#   grpo  GRPO (configs/baselines/grpo.yaml: VLM-R1's prompt, no data server)
#   sft   SFT continued on RL's task with exact targets (the base's own target and prompt: toy_base, toy)
#   bash experiments/sweeps/toy_base_rl.sh OUT_DIR [J]    then   python experiments/sweeps/toy_base_rl_table.py OUT_DIR
# BASE_MODEL=outputs/toy_base/stage4 starts every run from that export instead of checkpoints/toy-qwen2.5-vl;
# EXTRA="flags" are appended to every fit (a training setting for every method at once, never the held-out splits).
set -u
OUT=${1:?out dir}; J=${2:-2}; PY=${PY:-.venv/bin/python}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
mkdir -p "$OUT"
BASE="--config configs/tiny.yaml --config configs/overlays/heldout_summary.yaml --trainer.logger=false --trainer.enable_progress_bar=false"
[ -n "${BASE_MODEL:-}" ] && BASE="$BASE --model.init_args.policy.model_name_or_path=$BASE_MODEL"
BASE="$BASE ${EXTRA:-}"
declare -A M=(
  [syn]=""
  [grpo]="--config configs/baselines/grpo.yaml"
  [sft]="--config configs/baselines/sft.yaml --model.init_args.target=toy_base --model.init_args.prompt_template=toy"
)
jobs_list=()
for s in ${SEEDS:-0 1 2}; do for m in ${METHODS:-syn grpo sft}; do jobs_list+=("$m $s"); done; done
run() {
  local m=$1 s=$2 dir="$OUT/$1_s$2"
  [ -f "$dir/results/heldout.json" ] && return 0
  $PY train.py fit $BASE ${M[$m]} --seed_everything=$s --data.init_args.seed=$s --trainer.default_root_dir="$dir" > "$OUT/$1_s$2.log" 2>&1
  echo "$m seed $s rc $? $(grep -A3 'held-out greedy' "$OUT/$1_s$2.log" | tail -2 | tr -s ' ' | tr '\n' ' ')"
}
for j in "${jobs_list[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$J" ]; do sleep 5; done
  run $j &
done
wait
