#!/usr/bin/env bash
# Qwen3-Next on the GPU machine, carry [".whl", ".carry"]; results in $OUT.
#   bash scripts/gpu_next.sh tests   MoE kernel timings, then the MoE / DeltaNet / engine GPU tests
#   bash scripts/gpu_next.sh bench   Weir's nano-bench on qwen3-next-24l, then Qwen3-8B batch-1 latency
#   bash scripts/gpu_next.sh profile per-step time split and kernel tables on qwen3-next-24l, fp32 and
#                                    bfloat16 recurrent states (--linear-state-dtype)
#   bash scripts/gpu_next.sh conv    the prefill conv against fla's path (scripts/bench_gdn.py), then the
#                                    DeltaNet kernel and backend GPU tests
set -u
source benchmarks/device_setup.sh || exit 1
export PYTHONUNBUFFERED=1
case "${1:-tests}" in
  tests)
    timeout 120 python3 scripts/bench_moe.py > "$OUT/bench_moe.log" 2>&1; tail -15 "$OUT/bench_moe.log"
    timeout 420 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_moe_triton.py \
      tests/test_gdn_triton_kernels.py tests/test_gpu_qwen3_next.py tests/test_gated_kernels.py ${GPU_TESTS:-} > "$OUT/gpu-tests.log" 2>&1
    tail -40 "$OUT/gpu-tests.log" ;;
  bench)
    timeout 400 weir bench throughput benchmarks/models/qwen3-next-24l --load-format dummy --num-prompts 256 \
      --random-range 100:1024,100:1024 --temperature 0.6 --max-model-len 4096 --seed 0 \
      --output-json "$OUT/weir-next-256.json" > "$OUT/weir-next-256.log" 2>&1
    grep -v "it/s\]" "$OUT/weir-next-256.log" | tail -25
    timeout 150 weir bench latency benchmarks/models/qwen3-8b --load-format dummy --batch-size 1 --input-len 128 \
      --output-len 256 --num-iters 5 --num-iters-warmup 2 --max-model-len 4096 \
      --output-json "$OUT/weir-8b-bs1.json" > "$OUT/weir-8b-bs1.log" 2>&1
    grep -v "it/s\]" "$OUT/weir-8b-bs1.log" | tail -15 ;;
  profile)
    timeout 100 python3 scripts/bench_gdn.py 2>&1 | grep -v Warning | tail -8
    timeout 240 python3 scripts/profile_steps.py benchmarks/models/qwen3-next-24l > "$OUT/profile-next.log" 2>&1
    grep -v "it/s\]\|INFO\|tokenizer" "$OUT/profile-next.log" | tail -45
    timeout 200 weir bench throughput benchmarks/models/qwen3-next-24l --load-format dummy --num-prompts 256 \
      --random-range 100:1024,100:1024 --temperature 0.6 --max-model-len 4096 --seed 0 --linear-state-dtype bfloat16 \
      --output-json "$OUT/weir-next-256-bf16-state.json" > "$OUT/weir-next-256-bf16-state.log" 2>&1
    grep -E "Throughput|start-up" "$OUT/weir-next-256-bf16-state.log" ;;
  conv)
    timeout 150 python3 scripts/bench_gdn.py --only prefill-conv 2>&1 | grep -v Warn
    timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gdn_triton_kernels.py tests/test_backend_checks.py \
      > "$OUT/gpu-tests.log" 2>&1; tail -5 "$OUT/gpu-tests.log" ;;
esac
