# Issue 58, device call 2: the toy base's stage 2 (resumed or skipped when built; outputs/toy_base carried from call 1)
# and the yardstick with the gate on the new base under both prompts, each result written under $OUT as it is made.
#   bash experiments/sweeps/toy_base_device_gate.sh     (on the device; $OUT set by the harness)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
save() { mkdir -p $OUT/outputs $OUT/checkpoints; cp -r outputs/toy_base $OUT/outputs/ 2>/dev/null; cp -r checkpoints/toy-qwen2.5-vl $OUT/checkpoints/ 2>/dev/null; for d in outputs/toy_sft-base*; do [ -d $d ] && mkdir -p $OUT/$d && cp -r $d/checkpoints $d/metrics.jsonl $d/results $OUT/$d/ 2>/dev/null; done; }
( while sleep 60; do save; done ) &
timeout ${BUILD_S:-300} python -m runner.toy_build -- --data.init_args.num_workers 8 > $OUT/build.log 2>&1; echo build rc $?
save
for t in toy vlm_r1; do
  timeout 200 python bench/toy_yardstick.py outputs/toy_base/stage2 checkpoints/toy-qwen2.5-vl --template $t --out $OUT/yardstick_$t.json > $OUT/yardstick_$t.log 2>&1; echo yardstick $t rc $?
  grep -v "^ *$" $OUT/yardstick_$t.log | tail -14
done
