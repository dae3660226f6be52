#!/usr/bin/env bash
# Issue 40: toy-base candidates built side by side on one GPU, each read by the yardstick (bench/toy_yardstick.py:
# 512 val + 512 ood, greedy Acc@0.5 and the greedy answers' error kinds; the study's test splits are not read).
#   bash experiments/sweeps/toy_base_candidates.sh OUT_DIR STAGE NAME...      (STAGE 1: from scratch; 2: continues 1)
# Stage 1: configs/toy_sft.yaml (1,200 steps x 64 fresh scenes, lr 1e-3) with gradient clipping 1.0 and the candidate's
# flags. Stage 2: continues that stage 1 (1,800 steps x 64, lr 5e-4, clipping 1.0) on half `varied` scenes (the
# painter's images, as the committed recipe's stage 3) and, for a `bind` candidate, a quarter `bind` scenes.
# Candidates (NAME): a = the committed size, no mix; b = a + half `bind` scenes (every other object has the target's
# size); c = b at 5.8M parameters (hidden 256, 6 layers, vision 128 x 3); d = b at hidden 256, 4 layers, vision 128 x 2.
set -u
PY=${PY:-python}
OUT=${1:?out dir}; STAGE=${2:?stage 1 or 2}; shift 2
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
mkdir -p "$OUT"
# EXTRA: flags appended to every fit; SCENES: the yardstick's scenes (512: fixed; fewer only for a smoke run)
ACCEL=${ACCEL:-gpu}; PREC=${PREC:-bf16-mixed}; WORKERS=${WORKERS:-3}; MAXT=${MAXT:-00:00:07:00}
BT=--model.init_args.build_tiny
BIND='--data.init_args.toy.mix={"bind":0.5}'
declare -A FLAGS=(
  [a]=""
  [b]="$BIND"
  [c]="$BT.hidden_size=256 $BT.layers=6 $BT.heads=8 $BT.intermediate_size=768 $BT.vision_hidden_size=128 $BT.vision_depth=3 $BIND"
  [d]="$BT.hidden_size=256 $BT.layers=4 $BT.heads=8 $BT.intermediate_size=640 $BT.vision_hidden_size=128 $BIND"
)
build() {
  local n=$1 flags mix
  if [ "$STAGE" = 1 ]; then
    flags="${FLAGS[$n]} --model.init_args.policy.model_name_or_path=outputs/toyb_$n/init --trainer.val_check_interval=1200"
  else
    mix='{"varied":0.5}'; [ "$n" != a ] && mix='{"varied":0.5,"bind":0.25}'
    flags="--model.init_args.policy.model_name_or_path=outputs/toyb_$n/stage1 --model.init_args.build_tiny=null
      --trainer.max_steps=1800 --trainer.val_check_interval=1800 --model.init_args.warmup_ratio=0.02
      --model.init_args.optimizer.init_args.lr=5e-4 --data.init_args.toy.mix=$mix"
  fi
  # shellcheck disable=SC2086
  $PY train.py fit --config configs/toy_sft.yaml --name "toyb_${n}_s$STAGE" --trainer.accelerator=$ACCEL \
    --trainer.precision=$PREC --trainer.gradient_clip_val=1.0 --trainer.max_time=$MAXT --trainer.enable_progress_bar=false \
    --model.init_args.export_dir="outputs/toyb_$n/stage$STAGE" --data.init_args.data_root="data/toyb_$n" \
    --data.init_args.num_workers=$WORKERS $flags ${EXTRA:-} > "$OUT/build_${n}_s$STAGE.log" 2>&1 || echo "$n stage $STAGE failed"
  $PY bench/toy_yardstick.py "outputs/toyb_$n/stage$STAGE" --batch 128 --scenes "${SCENES:-512}" --out "$OUT/yard_${n}_s$STAGE.json" \
    > "$OUT/yard_${n}_s$STAGE.log" 2>&1 || echo "$n yardstick failed"
}
for n in "$@"; do build "$n" & done
wait
