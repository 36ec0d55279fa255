source benchmarks/device_setup.sh
python3 -c "import sys; print('flags', sys.flags.dont_write_bytecode, sys.pycache_prefix)"; env | grep -i -E "^PYTHON" 
T=/opt/torch/.venv/lib/python3.12/site-packages/transformers
ls $T/__pycache__ 2>&1 | head -3; ls $T/models/qwen3/__pycache__ 2>&1 | head -3; ls /opt/torch/.venv/lib/python3.12/site-packages/torch/__pycache__ | head -3
touch $T/zz_test && echo writable; rm -f $T/zz_test; mount | grep -E " / | /opt| /tmp" | head
C="from transformers import AutoConfig; AutoConfig.from_pretrained('benchmarks/models/qwen3-0.6b')"
for i in 1 2; do /usr/bin/time -f "run$i %e s" python3 -X importtime -c "import torch; $C" 2> $OUT/imp$i.log; tail -1 $OUT/imp$i.log; done
export PYTHONPYCACHEPREFIX=/tmp/pyc
for i in 3 4; do /usr/bin/time -f "run$i %e s" python3 -X importtime -c "import torch; $C" 2> $OUT/imp$i.log; tail -1 $OUT/imp$i.log; done
/usr/bin/time -f "tok %e s" python3 -c "import torch; from transformers import AutoTokenizer; AutoTokenizer.from_pretrained('benchmarks/models/qwen3-0.6b')" 2>&1 | tail -1
/usr/bin/time -f "weirimport %e s" python3 -c "import torch; import weir.llm" 2>&1 | tail -1
rm -rf /tmp/triton-startup; export TRITON_CACHE_DIR=/tmp/triton-startup
timeout 100 python3 scripts/startup_profile.py benchmarks/models/qwen3-0.6b > $OUT/startup-cold-pyc.log 2>&1; grep "ms weir\|STARTUP" $OUT/startup-cold-pyc.log
rm -rf /tmp/triton-startup
WEIR_COMPILE_AHEAD=0 timeout 100 python3 scripts/startup_profile.py benchmarks/models/qwen3-0.6b > $OUT/startup-cold-noahead.log 2>&1; grep "ms weir\|STARTUP" $OUT/startup-cold-noahead.log
