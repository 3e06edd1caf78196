#!/bin/bash
# The twenty-second session's GPU calls, carrying .whl (see README.md) and, for bench27b.sh, .bench-bin:
#   run 1: GPU tests of stream-K and of capture_guard's one collect per batch of captures (7629e2c, never run
#          on the GPU before); sweep_stream.py (stream-K at 2-8 programs per SM against split-K, every 27B
#          decode matrix); `bench decode` with split-K, with the sweep's best stream-K, and split-K again
#   run 2: bench27b.sh (with llama-bench) on the default, then the engine-wide GPU tests
#   run 3: bench agents (HiveJet) on the default
source .ci/gpu/env.sh
m27_start
if [ "$1" = 1 ]; then
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/kernels/test_packed.py \
        tests/engine/test_runner.py -k "stream_k or split_sums or captures_survive or graphs_equal_eager" \
        > "$OUT/gpu_tests_s22_1.txt" 2>&1
    grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests_s22_1.txt" | tail -8
    m27_wait
    timeout 280 python3 -u .ci/gpu/sweep_stream.py /tmp/m27.gguf --json "$OUT/sweep_stream.json" 2>&1 \
        | grep -v Warn > "$OUT/sweep_stream.txt"
    grep -E "sums in|per step|rows .* ms|Error" "$OUT/sweep_stream.txt" | tail -40
    BEST=$(python3 -c "import json; t=json.load(open('$OUT/sweep_stream.json'))['totals']
s=[r for r in t if r['rows']==1 and r['variant'].startswith('stream')]
print(min(s, key=lambda r: r['ms'])['variant'].split()[1].split('/')[0])" 2>/dev/null || echo 4)
    for v in 0 $BEST 0; do
        echo "HIVEJET_STREAM_K=$v"
        HIVEJET_STREAM_K=$v timeout 75 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --depths 0 \
            --rows 1 4 16 --json "$OUT/decode27b_stream$v.json" 2>&1 | grep -v Warn | tail -5
    done
fi
if [ "$1" = 2 ]; then
    timeout 240 bash .ci/gpu/bench27b.sh --rows 1 4 8 16 2>&1 | grep -v Warn | tail -14
    gpu_tests 300
fi
if [ "$1" = 3 ]; then
    agents hivejet 420
fi
