#!/usr/bin/env bash
# Qwen3-Next profiling call, carry [".whl", ".carry"]: GDN kernel timings, the engine's per-step
# profile on qwen3-next-24l, then the Qwen3-Next GPU tests again.
set -u
source benchmarks/device_setup.sh || exit 1
export PYTHONUNBUFFERED=1
timeout 120 python3 scripts/bench_gdn.py 2>&1 | grep -v Warning | tail -8
timeout 300 python3 scripts/profile_steps.py benchmarks/models/qwen3-next-24l > "$OUT/profile-next.log" 2>&1
grep -v "it/s\]\|INFO\|tokenizer" "$OUT/profile-next.log" | tail -45
timeout 160 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gpu_qwen3_next.py -k parity -s \
  > "$OUT/gpu-tests.log" 2>&1; grep -E "passed|failed|identical|relative|Error" "$OUT/gpu-tests.log" | tail -8
