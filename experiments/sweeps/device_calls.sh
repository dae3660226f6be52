#!/usr/bin/env bash
# The device calls of issues 55 and 57, each well inside 10 minutes, results under $OUT (one tarball of logs):
#   bash experiments/sweeps/device_calls.sh 3b        the 3B step: packed vs packed_shared, TRL in the same call
#   bash experiments/sweeps/device_calls.sh lean CONFIG   packed vs packed_shared only, 3 steps each
#   bash experiments/sweeps/device_calls.sh one SPEC      one run spec only, 3 steps
#   bash experiments/sweeps/device_calls.sh 3b80      the same on one 80 GB card (rec_3b_80gb)
#   bash experiments/sweeps/device_calls.sh 7b        the 7B recipe on one GPU (masters + moments in host memory)
#   bash experiments/sweeps/device_calls.sh profile   the 3B profile (component profiler)
#   bash experiments/sweeps/device_calls.sh fsdp      FSDP2 at one rank: fit -> kill -> resume against uninterrupted
#   bash experiments/sweeps/device_calls.sh cycle     issue 55: cycle_4b on the released parquet with a random Hiera-L
#                                                    VQ-SAM2: the decode share of its steps (an H200: fp32 masters)
#   bash experiments/sweeps/device_calls.sh mask      issue 55's decode alone: GPU and one CPU thread (~5 min)
#   bash experiments/sweeps/device_calls.sh auto      7b on a card of more than 100 GiB, fsdp on an 80 GB one
set -u
if [ "$1" = auto ]; then  # the largest unmeasured item this card can run: the 7B on a >100 GiB card, else FSDP2
  mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)
  if [ "${mib:-0}" -gt 100000 ]; then set -- 7b; else set -- fsdp; fi
  echo "auto: ${mib} MiB -> $1" >&2
fi
compgen -G ".whl/*.whl" > /dev/null || { echo "no wheels in .whl/: run ../shared/device/wheels.sh pycocotools here, delete .whl/wandb-* (20 MB; the benches drop the W&B logger) and carry .whl" >&2; exit 2; }
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=4
{ nvidia-smi --query-gpu=name,memory.total --format=csv; free -g; df -h /tmp /dev/shm; } > "$OUT/machine.txt" 2>&1
mkdir -p /tmp/pack
case "$1" in
3b)
  python bench/e2e_gpu.py --runs rec_3b_1gpu:off,rec_3b_1gpu+shared_prompt:off --trl --trl-steps 3 --epochs 1 \
    --train-samples 80 --timeout 270 --work /tmp/e2e3 --out "$OUT/e2e_gpu_rec_3b_1gpu_shared.json" > "$OUT/run.log" 2>&1
  for d in /tmp/e2e3/runs/*/; do cp "$d/metrics.jsonl" "/tmp/pack/$(basename "$d")_metrics.jsonl"; tail -60 "$d/train.log" > "/tmp/pack/$(basename "$d").log"; done ;;
lean)  # the least device time: packed vs packed_shared on CONFIG (rec_3b_1gpu on an H200, rec_3b_80gb on an H100)
  python bench/e2e_gpu.py --runs "$2:off,$2+shared_prompt:off" --epochs 1 --train-samples 60 --timeout 200 \
    --work /tmp/e2e3 --out "$OUT/e2e_gpu_$2_shared.json" > "$OUT/run.log" 2>&1
  for d in /tmp/e2e3/runs/*/; do cp "$d/metrics.jsonl" "/tmp/pack/$(basename "$d")_metrics.jsonl"; tail -60 "$d/train.log" > "/tmp/pack/$(basename "$d").log"; done ;;
one)  # a single run spec, 3 steps (e.g. rec_3b_80gb+shared_prompt:off)
  python bench/e2e_gpu.py --runs "$2" --epochs 1 --train-samples 60 --timeout 240 \
    --work /tmp/e2e3 --out "$OUT/e2e_gpu_one.json" > "$OUT/run.log" 2>&1
  for d in /tmp/e2e3/runs/*/; do cp "$d/metrics.jsonl" "/tmp/pack/$(basename "$d")_metrics.jsonl"; tail -60 "$d/train.log" > "/tmp/pack/$(basename "$d").log"; done ;;
3b80)  # one 80 GB card: the 3B recipe with its optimizer state in host memory, packed vs packed_shared
  python bench/e2e_gpu.py --runs rec_3b_80gb:off,rec_3b_80gb+shared_prompt:off --epochs 1 \
    --train-samples 80 --timeout 270 --work /tmp/e2e3 --out "$OUT/e2e_gpu_rec_3b_80gb_shared.json" > "$OUT/run.log" 2>&1
  for d in /tmp/e2e3/runs/*/; do cp "$d/metrics.jsonl" "/tmp/pack/$(basename "$d")_metrics.jsonl"; tail -60 "$d/train.log" > "/tmp/pack/$(basename "$d").log"; done ;;
7b)
  python bench/e2e_gpu.py --arch 7b --runs rec_7b_1gpu:off --epochs 1 --train-samples 80 --timeout 430 \
    --work /tmp/e2e7 --out "$OUT/e2e_gpu_rec_7b_1gpu.json" > "$OUT/run.log" 2>&1
  for d in /tmp/e2e7/runs/*/; do cp "$d/metrics.jsonl" "/tmp/pack/$(basename "$d")_metrics.jsonl"; tail -80 "$d/train.log" > "/tmp/pack/$(basename "$d").log"; done ;;
profile)
  python bench/e2e_gpu.py --runs rec_3b_1gpu:off --profile 2 --epochs 1 --train-samples 60 --timeout 240 \
    --work /tmp/e2e3 --out "$OUT/e2e_gpu_rec_3b_1gpu_profile.json" > "$OUT/run.log" 2>&1
  cp /tmp/e2e3/profile/*.log /tmp/e2e3/profile/*.json /tmp/pack/ 2>/dev/null
  for t in /tmp/e2e3/profile/*.trace.json; do  # the Chrome trace, compressed, when it is small enough to come back
    gzip -1 -c "$t" > "/tmp/$(basename "$t").gz" && [ "$(stat -c %s "/tmp/$(basename "$t").gz")" -lt 200000000 ] && mv "/tmp/$(basename "$t").gz" "$OUT/"
  done ;;
cycle)
  python bench/e2e_gpu.py --arch qwen3vl-4b --runs cycle_4b+cycle_4b_parquet:off --epochs 1 --train-samples 6 --val-samples 2 \
    --timeout 420 --work /tmp/e2ec --out "$OUT/e2e_gpu_cycle_4b_parquet_masks.json" > "$OUT/run.log" 2>&1
  for d in /tmp/e2ec/runs/*/; do cp "$d/metrics.jsonl" "/tmp/pack/$(basename "$d")_metrics.jsonl"; tail -60 "$d/train.log" > "/tmp/pack/$(basename "$d").log"; done ;;
mask)  # issue 55's decode: on the GPU, and on one CPU thread of this machine (one pair decoded each way)
  OMP_NUM_THREADS=1 timeout 500 taskset -c 15 python bench/mask_decode.py --size hiera-l --device cpu --threads 1 \
    --images 1 --codes 1 --out "$OUT/mask_decode_hiera_l_cpu1.json" > "$OUT/mask_cpu1.log" 2>&1 &
  timeout 200 python bench/mask_decode.py --size hiera-l --device cuda --images 4 --codes 12 \
    --out "$OUT/mask_decode_hiera_l.json" > "$OUT/mask.log" 2>&1 ;;
fsdp)  # ~8 min on an H100: N = 3, runs of ~135 + ~210 + ~95 s at 25 s a step, a 43 GiB save of ~80 s
  python bench/fsdp_resume.py --arch 3b --batch 8 --timeout 270 --work /tmp/fsdp \
    --out "$OUT/fsdp_resume.json" > "$OUT/fsdp.log" 2>&1 ;;
esac
echo "done in ${SECONDS}s" >> "$OUT/machine.txt"
wait
tar czf "$OUT/pack.tgz" -C /tmp/pack .
