#!/usr/bin/env bash
# Every test marked gpu, on a CUDA machine with Weir and its test dependencies installed
# (the README's second command). The whole log goes to OUT_DIR/gpu-tests.log, its end to the terminal.
# Verbose: a run cut off by a time limit still leaves each finished test's result in the log.
#   bash scripts/gpu_tests.sh OUT_DIR                                     every GPU test
#   bash scripts/gpu_tests.sh OUT_DIR tests/test_moe_triton.py -k fused   further pytest arguments
set -uo pipefail
if [ $# -lt 1 ]; then
  echo "usage: bash scripts/gpu_tests.sh OUT_DIR [PYTEST_ARGS...]" >&2
  exit 2
fi
out_dir=$1
shift
mkdir -p "$out_dir" || exit 1
log="$(cd "$out_dir" && pwd)/gpu-tests.log"
cd "$(dirname "$0")/.." || exit 1
python3 -m pytest -m gpu -v --tb=short -p no:cacheprovider "$@" > "$log" 2>&1
status=$?
tail -30 "$log"
exit $status
