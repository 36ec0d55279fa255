#!/usr/bin/env bash
# The profilers and kernel benchmarks on a CUDA machine with Weir installed (for Qwen3-Next and
# bench_gdn also fla-core: pip install -e '.[cuda]'). Each log goes to OUT_DIR, its end to the terminal.
#   bash benchmarks/profile.sh OUT_DIR kernels                   every benchmarks/kernel_bench/bench_*.py
#   bash benchmarks/profile.sh OUT_DIR startup [MODEL [KEY=VALUE...]]   start-up with an empty Triton
#                                   cache (every compilation timed), then again warm, with cProfile
#   bash benchmarks/profile.sh OUT_DIR steps [MODEL [OPTIONS...]]   time per step by kind and decode batch
#                                   size, then kernel tables of steady decode steps (profile_steps.py)
#   bash benchmarks/profile.sh OUT_DIR engine [MODEL [OPTIONS...]]  start-up phases, cold and warm runs,
#                                   device syncs per decode step (profile_engine.py)
# MODEL: a folder of benchmarks/models (default qwen3-0.6b) whose tokenizer.json is built
# (build_tokenizer.sh). E.g. the batch-1 kernel table of Qwen3-8B:
#   bash benchmarks/profile.sh OUT_DIR steps benchmarks/models/qwen3-8b --num-prompts 0 --profile-batch 1 --top 30
set -uo pipefail
if [ $# -lt 2 ]; then
  echo "usage: bash benchmarks/profile.sh OUT_DIR kernels|startup|steps|engine [MODEL [OPTIONS...]]" >&2
  exit 2
fi
out_dir=$(mkdir -p "$1" && cd "$1" && pwd) || exit 1
what=$2
shift 2
cd "$(dirname "$0")/.." || exit 1  # `python3 -m benchmarks...` runs from the repo root
model=${1:-benchmarks/models/qwen3-0.6b}
[ $# -gt 0 ] && shift
export PYTHONUNBUFFERED=1
status=0

run() {  # run LOG COMMAND...: the command's output into OUT_DIR/LOG
  local log="$out_dir/$1"
  shift
  "$@" > "$log" 2>&1 || status=$?
  tail -25 "$log"
}

case "$what" in
  kernels)
    for bench in attention input_prep small_ops gemv moe gdn; do
      run "bench_$bench.log" python3 -m "benchmarks.kernel_bench.bench_$bench"
    done ;;
  startup)
    TRITON_CACHE_DIR=$(mktemp -d) || exit 1  # empty: a cold machine's compiles; the warm run reuses it
    export TRITON_CACHE_DIR
    run startup-cold.log python3 -m benchmarks.startup_profile "$model" "$@"
    run startup-warm.log python3 -m benchmarks.startup_profile "$model" --cprofile 45 "$@"
    rm -rf "$TRITON_CACHE_DIR" ;;
  steps)
    run "profile-steps-$(basename "$model").log" python3 -m benchmarks.profile_steps "$model" "$@" ;;
  engine)
    run "profile-engine-$(basename "$model").log" python3 benchmarks/profile_engine.py "$model" "$@" ;;
  *)
    echo "unknown profile $what: kernels, startup, steps or engine" >&2
    exit 2 ;;
esac
exit $status
