#!/usr/bin/env bash
# The Qwen3-Next race call: vLLM 0.26 (keep_moe pack: part.00 and part.01 left in /tmp/peerparts by
# the two calls before, part.02 carried in .peerm2) and Weir on qwen3-next-24l. carry [".whl", ".carry", ".peerm2"]; earlier calls: carry [".peerm0"] then [".peerm1"],
# each `mkdir -p /tmp/peerparts && cp .peermN/part.* /tmp/peerparts/`.
set -u
source benchmarks/device_setup.sh || exit 1
export PYTHONUNBUFFERED=1
if [ ! -d /tmp/site/vllm ]; then
  cp .peerm2/part.* /tmp/peerparts/ && cat /tmp/peerparts/part.* | xz -d | tar -x -C /tmp/site || exit 1
fi
# Cold caches: Weir ~140 s to start + 25 s, vLLM ~200 s to start + 25 s, unpacking ~40 s; the
# bf16-state row (vLLM's state dtype) reuses the autotune cache: ~20 s start + 25 s.
timeout 560 python3 benchmarks/race.py "$OUT" --model qwen3-next-24l --sizes 256 \
  --variant 'bf16-state=--linear-state-dtype bfloat16' 2>&1 | tail -14
