#!/usr/bin/env bash
# The race call: vLLM (unpacked from the carried .peer2/part.01 plus the part.00 an earlier call
# left in /tmp/peerparts) and Weir on the nano-bench. carry [".whl", ".carry", ".peer2"].
set -u
source benchmarks/device_setup.sh || exit 1
export PYTHONUNBUFFERED=1
if [ ! -d /tmp/site/vllm ]; then
  cp .peer2/part.* /tmp/peerparts/ && cat /tmp/peerparts/part.* | xz -d | tar -x -C /tmp/site || exit 1
fi
python3 benchmarks/race.py "$OUT" --sizes 256,1024 2>&1 | tail -20
