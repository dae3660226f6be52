python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total --format=csv > $OUT/gpu.txt
save() { mkdir -p $OUT/outputs; cp -r outputs/toy_base $OUT/outputs/ 2>/dev/null; for d in outputs/toy_sft-base*; do [ -d $d ] && mkdir -p $OUT/$d && cp -r $d/checkpoints $d/metrics.jsonl $d/results $OUT/$d/ 2>/dev/null; done; }
( while sleep 60; do save; done ) &
timeout 530 python -m runner.toy_build --only base1 base2 -- --data.init_args.num_workers 8 > $OUT/build.log 2>&1; echo build rc $?
save; tail -c 3000 $OUT/build.log | tr '\r' '\n' | grep -v "^ *$" | tail -30; ls -la $OUT/outputs/*
