#!/usr/bin/env bash
# Issue 40, step 3 probe: which RL setting moves the toy checkpoint's greedy Acc@0.5 on the yardstick's VALIDATION
# splits (bench/toy_yardstick.py: 512 val + 512 ood; the study's test splits are not read). One device call, fits on
# the GPU side by side, each exported and read by the yardstick.
#   bash experiments/sweeps/toy_rl_probe.sh OUT_DIR [STEPS] [ACCEL]     (STEPS 64 prompts-of-16 steps; ACCEL gpu|cpu)
#   START=path: another starting checkpoint than checkpoints/toy-qwen2.5-vl (policy and reference)
#   ONLY="name ...": only these variants; EXTRA=flags appended to every fit (e.g. --trainer.max_time=00:00:07:00)
#   RESUME=1: continue each fit from its run folder's last.ckpt (a second device call on the same warm machine; give
#     EXTRA a larger max_time: the Timer's elapsed time is restored); NOEVAL=1: fit only, no export or yardstick
# Variants: NAME|overlay configs|flags (see the list below). Each run trains on fresh scenes seen once.
set -u
PY=${PY:-python}
OUT=${1:?out dir}; STEPS=${2:-64}; ACCEL=${3:-gpu}; BATCH=${BATCH:-16}
export OMP_NUM_THREADS=1 MKL_NUM_THREADS=1
mkdir -p "$OUT"
# a machine without wandb (the device): the base config without its W&B logger (the runs log metrics.jsonl only)
BASE=configs/tiny.yaml
if ! $PY -c "import wandb" 2>/dev/null; then
  BASE=/tmp/tiny_nowandb.yaml
  $PY - <<'PYEOF'
import re
s = open("configs/tiny.yaml").read()
s = re.sub(r"  logger:.*\n(    .*\n)+", "  logger: false\n", s, count=1)
open("/tmp/tiny_nowandb.yaml", "w").write(s)
PYEOF
fi
START=${START:-checkpoints/toy-qwen2.5-vl}
N=$((STEPS * BATCH))
ENG=""; [ "$ACCEL" = gpu ] && ENG="--model.init_args.engines.rollout_engine=fast"
GRPO="--config configs/baselines/grpo.yaml"
SFT="--config configs/baselines/sft.yaml"
VARIANTS=(
  "start_vlm_r1|-|"
  "start_toy|-|"
  "grpo_t10|$GRPO|"
  "grpo_t07|$GRPO|--model.init_args.sampling.temperature=0.7"
  "grpo_t05|$GRPO|--model.init_args.sampling.temperature=0.5"
  "grpo_t07_lr1e4|$GRPO|--model.init_args.sampling.temperature=0.7 --model.init_args.optimizer.init_args.lr=1e-4"
  "grpo_t07_g12|$GRPO|--model.init_args.sampling.temperature=0.7 --model.init_args.sampling.group_size=12 --data.init_args.batch_size=8"
  "grpo_t07_crowded|$GRPO|--model.init_args.sampling.temperature=0.7 --data.init_args.toy.mix={\"crowded\":0.5}"
  "syn_t07|-|--model.init_args.sampling.temperature=0.7"
  "sft|$SFT|"
  "grpo_t07_g12_s1|$GRPO|--model.init_args.sampling.temperature=0.7 --model.init_args.sampling.group_size=12 --data.init_args.batch_size=8 --seed_everything=1 --data.init_args.seed=1"
  "grpo_t07_g12_s2|$GRPO|--model.init_args.sampling.temperature=0.7 --model.init_args.sampling.group_size=12 --data.init_args.batch_size=8 --seed_everything=2 --data.init_args.seed=2"
  "grpo_t10_g12|$GRPO|--model.init_args.sampling.group_size=12 --data.init_args.batch_size=8"
  "grpo_t07_g24|$GRPO|--model.init_args.sampling.temperature=0.7 --model.init_args.sampling.group_size=24 --data.init_args.batch_size=4"
  # second probe (2026-12-05, later): no KL, a larger lr, and the fair SFT control (the toy's own target and prompt)
  "grpo_t07_g12_kl0|$GRPO|--model.init_args.sampling.temperature=0.7 --model.init_args.sampling.group_size=12 --data.init_args.batch_size=8 --model.init_args.kl.coef=0.0"
  "grpo_t07_g12_lr5e5|$GRPO|--model.init_args.sampling.temperature=0.7 --model.init_args.sampling.group_size=12 --data.init_args.batch_size=8 --model.init_args.optimizer.init_args.lr=5e-5"
  "grpo_t07_g12_lr5e5_kl0|$GRPO|--model.init_args.sampling.temperature=0.7 --model.init_args.sampling.group_size=12 --data.init_args.batch_size=8 --model.init_args.optimizer.init_args.lr=5e-5 --model.init_args.kl.coef=0.0"
  "grpo_t07_g12_lr1e5|$GRPO|--model.init_args.sampling.temperature=0.7 --model.init_args.sampling.group_size=12 --data.init_args.batch_size=8 --model.init_args.optimizer.init_args.lr=1e-5"
  "sft_toy|$SFT|--model.init_args.target=toy_grounded --model.init_args.prompt_template=toy"
  "syn_t07_g12|-|--model.init_args.sampling.temperature=0.7 --model.init_args.sampling.group_size=12 --data.init_args.batch_size=8"
  # 2026-12-06: seeds 1-2 of the SFT control and of Syn-GRPO, for the 3-seed comparison from the stage-4 base
  "sft_toy_s1|$SFT|--model.init_args.target=toy_grounded --model.init_args.prompt_template=toy --seed_everything=1 --data.init_args.seed=1"
  "sft_toy_s2|$SFT|--model.init_args.target=toy_grounded --model.init_args.prompt_template=toy --seed_everything=2 --data.init_args.seed=2"
  "syn_t07_g12_s1|-|--model.init_args.sampling.temperature=0.7 --model.init_args.sampling.group_size=12 --data.init_args.batch_size=8 --seed_everything=1 --data.init_args.seed=1"
  "syn_t07_g12_s2|-|--model.init_args.sampling.temperature=0.7 --model.init_args.sampling.group_size=12 --data.init_args.batch_size=8 --seed_everything=2 --data.init_args.seed=2"
  # 2026-12-06 (session 29): the "far more scenes" lever; 32 prompts a step (4x the G 12 probe's), over two calls
  # (micro-batches of 96 completions: the same update as 12s, fewer launches on the GPU)
  "grpo_long|$GRPO|--model.init_args.sampling.temperature=0.7 --model.init_args.sampling.group_size=12 --data.init_args.batch_size=32 --model.init_args.engines.micro_batch_size=96"
  "grpo_long_s1|$GRPO|--model.init_args.sampling.temperature=0.7 --model.init_args.sampling.group_size=12 --data.init_args.batch_size=32 --seed_everything=1 --data.init_args.seed=1 --model.init_args.engines.micro_batch_size=96"
  "grpo_long_s2|$GRPO|--model.init_args.sampling.temperature=0.7 --model.init_args.sampling.group_size=12 --data.init_args.batch_size=32 --seed_everything=2 --data.init_args.seed=2 --model.init_args.engines.micro_batch_size=96"
  "syn_long|-|--model.init_args.sampling.temperature=0.7 --model.init_args.sampling.group_size=12 --data.init_args.batch_size=32 --model.init_args.engines.micro_batch_size=96"
  "syn_long_s1|-|--model.init_args.sampling.temperature=0.7 --model.init_args.sampling.group_size=12 --data.init_args.batch_size=32 --seed_everything=1 --data.init_args.seed=1 --model.init_args.engines.micro_batch_size=96"
  "syn_long_s2|-|--model.init_args.sampling.temperature=0.7 --model.init_args.sampling.group_size=12 --data.init_args.batch_size=32 --seed_everything=2 --data.init_args.seed=2 --model.init_args.engines.micro_batch_size=96"
  "sft_long_toy|$SFT|--model.init_args.target=toy_grounded --model.init_args.prompt_template=toy --data.init_args.batch_size=32"
  "sft_long_toy_s1|$SFT|--model.init_args.target=toy_grounded --model.init_args.prompt_template=toy --data.init_args.batch_size=32 --seed_everything=1 --data.init_args.seed=1"
  "sft_long_toy_s2|$SFT|--model.init_args.target=toy_grounded --model.init_args.prompt_template=toy --data.init_args.batch_size=32 --seed_everything=2 --data.init_args.seed=2"
)
# a variant's last.ckpt: its run folder is outputs/probe_<name> or outputs/probe_<name>-<method>, never a longer
# variant's (probe_<name>_kl0)
last_ckpt() {
  ls -d outputs/probe_$1/checkpoints/last.ckpt outputs/probe_$1-*/checkpoints/last.ckpt 2>/dev/null | head -1
}
run_one() {
  local name=$1 cfg=$2 flags=$3 tmpl=vlm_r1 ckpt
  # the toy prompt for the runs trained with it (Syn-GRPO, the SFT control) and its start; VLM-R1's for GRPO
  # (until 2026-12-06 a name pattern missed sft_toy_s1 / _s2, which probe 6 read with VLM-R1's prompt)
  if [[ $name == start_toy || $name == syn_* || $flags == *prompt_template=toy* ]]; then tmpl=toy; fi
  if [[ $name == start_* ]]; then
    $PY bench/toy_yardstick.py "$START" --template $tmpl --out "$OUT/$name.json" > "$OUT/$name.log" 2>&1
    return
  fi
  [ "$cfg" = "-" ] && cfg=""
  local resume=""
  if [ -n "${RESUME:-}" ]; then
    ckpt=$(last_ckpt "$name")
    [ -n "$ckpt" ] || { echo "$name: RESUME=1 but no last.ckpt under outputs/probe_${name}*: run it once without RESUME (on a device, in the same warm machine's session), then resume"; return; }
    resume="--ckpt_path $ckpt"
  else
    rm -rf "outputs/probe_${name}" outputs/probe_"${name}"-*   # an earlier probe's run of this variant (its START may differ)
    : > "$OUT/$name.log"   # a resumed fit appends to its first call's log; a new one starts its own
  fi
  local b=$BATCH eng=$ENG; [[ $flags =~ batch_size=([0-9]+) ]] && b=${BASH_REMATCH[1]}
  [[ $name == sft* ]] && eng=""   # SFT has no rollout engine
  local steps=$((N / b))
  # shellcheck disable=SC2086
  $PY train.py fit --config $BASE $cfg --name "probe_$name" --trainer.accelerator=$ACCEL $eng \
    --model.init_args.policy.model_name_or_path="$START" \
    --data.init_args.data_root="/tmp/probe_data_$name" "--data.init_args.toy.splits={\"train\": $N, \"val\": 16, \"ood\": 16}" \
    --data.init_args.batch_size=$b --trainer.max_epochs=1 --trainer.limit_val_batches=0 \
    --trainer.logger=false --trainer.enable_progress_bar=false --callbacks.gallery=null --callbacks.completions=null \
    --callbacks.checkpoint.init_args.every_n_train_steps=null --callbacks.checkpoint.init_args.every_n_epochs=1 $flags ${EXTRA:-} $resume >> "$OUT/$name.log" 2>&1 || { echo "$name fit failed"; return; }
  ckpt=$(last_ckpt "$name")
  cp "$(dirname "$ckpt")/../metrics.jsonl" "$OUT/${name}_metrics.jsonl" 2>/dev/null
  [ -n "${NOEVAL:-}" ] && return
  # shellcheck disable=SC2086
  $PY train.py export --config $BASE $cfg --ckpt_path "$ckpt" --out "/tmp/probe_export_$name" >> "$OUT/$name.log" 2>&1 \
    || { echo "$name export failed"; return; }
  $PY bench/toy_yardstick.py "/tmp/probe_export_$name" --template $tmpl --out "$OUT/$name.json" >> "$OUT/$name.log" 2>&1
}
for v in "${VARIANTS[@]}"; do
  IFS='|' read -r name cfg flags <<< "$v"
  [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]] && continue
  run_one "$name" "$cfg" "$flags" &
done
wait
$PY - "$OUT" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    r = json.loads(f.read_text())["results"][0]
    print(f"{f.stem:<20}", " ".join(f"{s}: greedy {r[s]['greedy_acc50']*100:5.1f} pass@6 {r[s]['pass_at_g']*100:5.1f} "
          f"sampled {r[s]['sampled_acc50']*100:5.1f} div {r[s]['response_diversity']:.3f} H {r[s]['answer_entropy']:.3f}" for s in ("val", "ood")))
PY
