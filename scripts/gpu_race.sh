#!/usr/bin/env bash
# The race call: vLLM (unpacked from the carried .peer2/part.01 plus the part.00 an earlier call
# left in /tmp/peerparts) and Weir on the nano-bench, then Weir's profile. carry [".whl", ".carry", ".peer2"].
set -u
source benchmarks/device_setup.sh || exit 1
export PYTHONUNBUFFERED=1
if [ ! -d /tmp/site/vllm ]; then
  cp .peer2/part.* /tmp/peerparts/ && cat /tmp/peerparts/part.* | xz -d | tar -x -C /tmp/site || exit 1
fi
python3 benchmarks/race.py "$OUT" --sizes 256,1024 2>&1 | tail -20
timeout 200 python3 benchmarks/profile_engine.py > "$OUT/profile.log" 2>&1; grep -E "STARTUP|nano-bench|decode window|per step|ms weir" "$OUT/profile.log"
