#!/usr/bin/env bash
# Source this at the start of a GPU-machine call (see benchmarks/README.md): installs the carried
# wheels (.whl/, including Weir's own, built here with `pip wheel --no-deps -w .whl .`) into
# /tmp/site and unpacks the Qwen tokenizer (.carry/qwen3-tokenizer.json.xz) into the model folders.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || return 1
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PATH=/tmp/site/bin:$PATH
for model in benchmarks/models/*/; do
  [ -f "$model/tokenizer.json" ] || xz -dc .carry/qwen3-tokenizer.json.xz > "$model/tokenizer.json"
done
export TRITON_CACHE_AUTOTUNING=1  # later processes of one call reuse fla's autotune results
