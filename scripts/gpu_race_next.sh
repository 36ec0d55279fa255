#!/usr/bin/env bash
# The Qwen3-Next race call: vLLM 0.26 (keep_moe pack: part.00 and part.01 left in /tmp/peerparts by
# the two calls before, part.02 carried in .peerm2) and Weir on qwen3-next-24l, then the Qwen3-Next
# GPU tests. carry [".whl", ".carry", ".peerm2"]; earlier calls: carry [".peerm0"] then [".peerm1"],
# each `mkdir -p /tmp/peerparts && cp .peermN/part.* /tmp/peerparts/`.
set -u
source benchmarks/device_setup.sh || exit 1
export PYTHONUNBUFFERED=1
if [ ! -d /tmp/site/vllm ]; then
  cp .peerm2/part.* /tmp/peerparts/ && cat /tmp/peerparts/part.* | xz -d | tar -x -C /tmp/site || exit 1
fi
timeout 440 python3 benchmarks/race.py "$OUT" --model qwen3-next-24l --sizes 256 2>&1 | tail -12
timeout 130 python3 -m pytest -m gpu -q -p no:cacheprovider tests/test_gated_kernels.py tests/test_gpu_qwen3_next.py \
  -k "cuda or parity" -s > "$OUT/gpu-tests.log" 2>&1; grep -E "passed|failed|identical|error|Error" "$OUT/gpu-tests.log" | tail -12
