#!/usr/bin/env bash
# One GPU-machine call: start-up phases, the nano-bench run cold and warm, a profiled decode window,
# and the GPU tests. carry [".whl", ".carry"]; results go to $OUT.
set -u
source benchmarks/device_setup.sh || exit 1
export PYTHONUNBUFFERED=1
timeout 300 python3 benchmarks/profile_engine.py > "$OUT/profile.log" 2>&1; grep -v "^\s*$" "$OUT/profile.log" | head -80
timeout 240 python3 -m pytest -m gpu -q -p no:cacheprovider -k "not default_model" --ignore-glob='tests/test_server_*' \
  tests > "$OUT/gpu-tests.log" 2>&1; tail -30 "$OUT/gpu-tests.log"
