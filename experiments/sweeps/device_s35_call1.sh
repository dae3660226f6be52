#!/usr/bin/env bash
# Session 35, device call 1 (issue 57): the 7B recipe on one GPU, then the 3B profile if time is left.
set -u
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD OMP_NUM_THREADS=4
{ nvidia-smi --query-gpu=name,memory.total --format=csv; free -g; df -h /tmp; } > "$OUT/machine.txt" 2>&1
python bench/e2e_gpu.py --arch 7b --runs rec_7b_1gpu:off --epochs 1 --train-samples 60 --timeout 450 \
  --work /tmp/e2e7 --out "$OUT/e2e_gpu_rec_7b_1gpu.json" > "$OUT/7b.log" 2>&1
mkdir -p /tmp/pack
cp /tmp/e2e7/runs/*/metrics.jsonl /tmp/pack/7b_metrics.jsonl 2>/dev/null
tail -80 /tmp/e2e7/runs/*/train.log > /tmp/pack/7b_train_tail.log 2>/dev/null
rm -rf /tmp/e2e7
left=$((560 - SECONDS))
echo "after 7B: ${SECONDS}s" >> "$OUT/machine.txt"
if [ "$left" -gt 200 ]; then
  python bench/e2e_gpu.py --runs rec_3b_1gpu:off --profile 3 --epochs 1 --train-samples 60 --timeout $((left / 2)) \
    --work /tmp/e2e3 --out "$OUT/e2e_gpu_rec_3b_1gpu_profile.json" > "$OUT/3b.log" 2>&1
  cp /tmp/e2e3/profile/*.log /tmp/pack/ 2>/dev/null
fi
tar czf "$OUT/pack.tgz" -C /tmp/pack .
