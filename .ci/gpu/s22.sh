#!/bin/bash
# The twenty-second session's GPU calls, carrying .whl (see README.md) and, for bench27b.sh, .bench-bin:
#   run 1: GPU tests of stream-K and of capture_guard's one collect per batch of captures (7629e2c, never run
#          on the GPU before); sweep_stream.py (stream-K at 2-8 programs per SM against split-K, every 27B
#          decode matrix); `bench decode` with split-K, with the sweep's best stream-K, and split-K again
#   run 2 (with .ci/gpu/packed_before_negmins.py, an untracked copy of kernels/quant/packed.py before the mins
#          were stored negated; not committed): the packed matmul's and the runner's GPU tests; `bench decode`
#          with the negated mins, without, with; matmul_shapes.py
#   run 3: sweep_split.py (every split count on every 27B decode matrix); `bench decode` with split-K's
#          targets HIVEJET_DECODE_WAVES at the default (128:8,64:4) and 128:8,64:8
#   run 4 (and .bench-bin): `bench decode` with HIVEJET_DECODE_WAVES 128:8,64:4 / 128:8,64:8 twice each,
#          alternating; then bench27b.sh (with llama-bench) with the faster of the two at one row
# What ran (2026-12-03, docs/PERFORMANCE.md twenty-second section): runs 1-4 as written (run 1's sweep_stream.py
# and stream-K tests are in commit 863ecd8, taken out in the next; run 2's untracked copy was removed after),
# then two plain calls with HIVEJET_DECODE_WAVES=128:8,64:8: `bench agents --scenarios 1 2 3` and the GPU tests
# of test_packed.py, test_runner.py and test_engine_runner.py (-k "not smollm2 and not gemma3").
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
    timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/kernels/test_packed.py \
        tests/engine/test_runner.py -k "not smollm2 and not gemma3" > "$OUT/gpu_tests_s22_2.txt" 2>&1
    grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests_s22_2.txt" | tail -8
    m27_wait
    cp kernels/quant/packed.py /tmp/packed_new.py
    for v in new old new; do
        if [ $v = old ]; then cp .ci/gpu/packed_before_negmins.py kernels/quant/packed.py
        else cp /tmp/packed_new.py kernels/quant/packed.py; fi
        echo "mins: $v"
        timeout 75 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --depths 0 --rows 1 4 16 \
            --json "$OUT/decode27b_mins_$v.json" 2>&1 | grep -v Warn | tail -4
    done
    timeout 110 python3 -u .ci/gpu/matmul_shapes.py /tmp/m27.gguf --json "$OUT/matmul_shapes.json" 2>&1 \
        | grep -v Warn | tail -13
fi
if [ "$1" = 3 ]; then
    m27_wait
    timeout 330 python3 -u .ci/gpu/sweep_split.py /tmp/m27.gguf --json "$OUT/sweep_split.json" 2>&1 \
        | grep -v Warn > "$OUT/sweep_split.txt"
    grep -E "^  |step's" "$OUT/sweep_split.txt" | tail -26
    for v in 128:8,64:4 128:8,64:8; do
        echo "HIVEJET_DECODE_WAVES=$v"
        HIVEJET_DECODE_WAVES=$v timeout 75 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --depths 0 \
            --rows 1 4 16 --json "$OUT/decode27b_waves_${v//[:,]/_}.json" 2>&1 | grep -v Warn | tail -4
    done
fi
if [ "$1" = 4 ]; then
    m27_wait
    for v in 128:8,64:4 128:8,64:8 128:8,64:4 128:8,64:8; do
        n=$((n + 1))
        echo "HIVEJET_DECODE_WAVES=$v"
        HIVEJET_DECODE_WAVES=$v timeout 70 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --depths 0 \
            --rows 1 4 16 --json "$OUT/decode27b_waves_${v//[:,]/_}_$n.json" 2>&1 | grep -v Warn | tail -4
    done
    BEST=$(python3 -c "import glob, json
t = {}
for f in glob.glob('$OUT/decode27b_waves_*.json'):
    v = f.split('waves_')[1].rsplit('_', 1)[0]
    t.setdefault(v, []).append(json.load(open(f))['rows'][0]['ms'])
v = min(t, key=lambda v: sum(t[v]) / len(t[v]))
print('128:8,64:' + v.split('_')[-1])" 2>/dev/null || echo 128:8,64:8)
    echo "bench27b with HIVEJET_DECODE_WAVES=$BEST"
    HIVEJET_DECODE_WAVES=$BEST timeout 250 bash .ci/gpu/bench27b.sh --rows 1 4 8 16 2>&1 | grep -v Warn | tail -14
fi
