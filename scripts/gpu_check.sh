#!/usr/bin/env bash
# One GPU-machine call: GPU tests, Weir's nano-bench, kernel timings. Run from the repo root with
# carry [".whl", ".carry"]; results go to $OUT.
set -u
source benchmarks/device_setup.sh || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
timeout 240 weir bench throughput benchmarks/models/qwen3-0.6b --load-format dummy --num-prompts 256 \
  --random-range 100:1024,100:1024 --temperature 0.6 --max-model-len 4096 --output-json "$OUT/weir-256.json" \
  > "$OUT/weir-256.log" 2>&1; tail -5 "$OUT/weir-256.log"
timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not default_model" tests ${GPU_TESTS:-} \
  > "$OUT/gpu-tests.log" 2>&1; tail -25 "$OUT/gpu-tests.log"
for bench in bench_attention bench_input_prep bench_small_ops; do
  timeout 90 python3 scripts/$bench.py > "$OUT/$bench.log" 2>&1; tail -25 "$OUT/$bench.log"
done
