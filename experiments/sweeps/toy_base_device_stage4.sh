# Issue 58, device call: the toy base's stage 4 (configs/toy_sft_stage_base4.yaml, 2,500 x 64) on one GPU, resumed
# from its own last.ckpt when a previous call stopped it, then the yardstick with the gate on its export. Carry
# outputs/toy_base/stage3 (and outputs/toy_sft-base4 to resume) and .whl (the project's pure-Python dependencies plus
# faster-coco-eval and pycocotools, which the device lacks: the validation's mAP needs one). Every result goes under $OUT
# as it is made, as one archive (the device hands back a few files per call, not a model folder's eight).
# Ran 2026-12-07 on one H100 80GB: the stage in 375 s, the gate in 55 s (experiments/toy_base.md).
#   bash experiments/sweeps/toy_base_device_stage4.sh     (on the device; $OUT set by the harness)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
save() { tar czf $OUT/base4.tgz.tmp outputs/toy_base/stage4 outputs/toy_sft-base4 2>/dev/null && mv $OUT/base4.tgz.tmp $OUT/base4.tgz; }
( while sleep 45; do save; done ) &
timeout ${BUILD_S:-420} python -m runner.toy_build --only base4 -- --trainer.accelerator gpu --data.init_args.num_workers 12 > $OUT/build.log 2>&1; echo build rc $?
save
tr '\r' '\n' < $OUT/build.log | grep -v "^ *$" | grep -v "it/s\]$" | tail -25
if [ -f outputs/toy_base/stage4/BUILD ]; then
  timeout ${YARD_S:-120} python bench/toy_yardstick.py outputs/toy_base/stage4 --bind 0 --out $OUT/yardstick_stage4.json > $OUT/yardstick_stage4.log 2>&1; echo yardstick rc $?
  grep -v "^ *$" $OUT/yardstick_stage4.log | tail -16
fi
