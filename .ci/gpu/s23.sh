#!/bin/bash
# The twenty-third session's GPU calls, carrying .whl (see README.md), .bench-srv for run 3. What ran (2026-12-03/04,
# docs/PERFORMANCE.md twenty-third section): runs 5, 6, 7, 8 in that order, then run 1's agents benchmark and
# llama-server's scenarios 1 / 2 3 5 / 4 as plain calls; run 6 covered run 2 (once each); run 4 did not run:
#   run 1: the full agents benchmark on the twenty-second session's split target (scenarios 4 and 5 were not
#          run on it), then the engine-wide GPU tests with the time left
#   run 2: small prompt chunks on the decode split target against their own (SMALL_PROMPT_WAVES 64:4, kept
#          because the new target was never measured on them): `bench agents --scenarios 1 3` alternating
#          HIVEJET_SMALL_PROMPT_WAVES=128:8,64:8 and the default, twice each
#   run 3: llama-server's scenarios 1-3 (SCEN="1 2 3"), then 5 (SCEN=5) in a second call: never re-run since
#          the thirteenth session
#   run 4 (check out 3cfb33f first, and .bench-bin): the row-pair layout, `s19.sh 2`
#   run 5: Q4_K's mins through group sums of x (mins_by_sums): the packed matmul's GPU tests, matmul_shapes.py
#          --mins (every decode matrix; the Q4_K ones with the mins in every value / by sums the kernel makes /
#          by means handed over), `bench decode` with HIVEJET_MINS_BY_SUMS=0 and 1. It ran (2026-12-03) on
#          commit ea129a7, whose mins_by_sums, matmul_shapes.py --mins and tests the next commit took out
#          (measured no gain: docs/PERFORMANCE.md, twenty-third session); kept as the record of what ran
#   run 6 (it writes .ci/gpu/packed_nodeq.py, see below): matmul_shapes.py with the nibbles not extracted
#          (the loop's instructions without dequantization: what it could gain at most) and as committed; small
#          prompt chunks on the decode split target against their own (run 2, once each)
#   run 7: launch_cost.py (the fixed cost of each decode matrix's launch), then the engine-wide GPU tests
#   run 8: 128-row tiles for every matrix (HIVEJET_PACKED_WIDE_ROWS=0) against 64-row ones below 16384 rows (the
#          default): `bench decode` with the default, 128-row tiles everywhere at split-K targets of 8 and 4
#          programs per SM, the default again; then matmul_shapes.py with 128-row tiles
source .ci/gpu/env.sh
m27_start
if [ "$1" = 1 ]; then
    agents hivejet 430
    gpu_tests 150
fi
if [ "$1" = 2 ]; then
    m27_wait
    for v in 128:8,64:8 "" 128:8,64:8 ""; do
        n=$((n + 1))
        echo "HIVEJET_SMALL_PROMPT_WAVES=${v:-default}"
        env ${v:+HIVEJET_SMALL_PROMPT_WAVES=$v} timeout 140 python3 -u -m app.cli bench agents -m /tmp/m27.gguf \
            --device cuda --servers hivejet --scenarios 1 3 --json "$OUT/agents_small_${v//[:,]/_}_$n.json" 2>&1 \
            | grep -v Warn | tail -6
    done
fi
if [ "$1" = 3 ]; then
    SCEN="${SCEN:-1 2 3}" bash .ci/gpu/s21.sh 3
fi
if [ "$1" = 4 ]; then
    bash .ci/gpu/s19.sh 2
fi
if [ "$1" = 5 ]; then
    grep -q -- --mins .ci/gpu/matmul_shapes.py || { echo "run 5 needs commit ea129a7 (mins_by_sums)"; exit 1; }
    timeout 130 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/kernels/test_packed.py \
        > "$OUT/gpu_tests_packed.txt" 2>&1
    grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests_packed.txt" | tail -8
    m27_wait
    timeout 230 python3 -u .ci/gpu/matmul_shapes.py /tmp/m27.gguf --mins --json "$OUT/matmul_shapes_mins.json" 2>&1 \
        | grep -v Warn | tail -40
    for v in 0 1; do
        echo "HIVEJET_MINS_BY_SUMS=$v"
        HIVEJET_MINS_BY_SUMS=$v timeout 70 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --depths 0 \
            --rows 1 4 16 --json "$OUT/decode27b_minsums$v.json" 2>&1 | grep -v Warn | tail -4
    done
fi
if [ "$1" = 6 ]; then
    # packed_nodeq.py: kernels/quant/packed.py with _nibbles_f16's PTX only moving the plane's word into its four
    # outputs (wrong values; the loop's loads, scales, dot and split-K as they are, without the nibbles' extraction)
    m27_wait
    cp kernels/quant/packed.py /tmp/packed_orig.py
    python3 - <<'PY'
s = open("kernels/quant/packed.py").read()
i = s.index("            .reg .b32 t0, t1, c0, c1, c2;")
j = s.index("            }", i)
open(".ci/gpu/packed_nodeq.py", "w").write(
    s[:i] + "".join(f"            mov.b32 ${o}, $4;\n" for o in range(4)) + s[j:])
PY
    for v in nodeq orig; do
        if [ $v = nodeq ]; then cp .ci/gpu/packed_nodeq.py kernels/quant/packed.py; else cp /tmp/packed_orig.py kernels/quant/packed.py; fi
        echo "matmuls: $v"
        timeout 120 python3 -u .ci/gpu/matmul_shapes.py /tmp/m27.gguf --json "$OUT/matmul_shapes_$v.json" 2>&1 \
            | grep -v Warn | tail -12
    done
    for v in 128:8,64:8 ""; do
        echo "HIVEJET_SMALL_PROMPT_WAVES=${v:-default}"
        env ${v:+HIVEJET_SMALL_PROMPT_WAVES=$v} timeout 135 python3 -u -m app.cli bench agents -m /tmp/m27.gguf \
            --device cuda --servers hivejet --scenarios 1 3 --json "$OUT/agents_small_${v//[:,]/_}.json" 2>&1 \
            | grep -v Warn | tail -6
    done
fi
if [ "$1" = 7 ]; then
    m27_wait
    timeout 300 python3 -u .ci/gpu/launch_cost.py /tmp/m27.gguf --json "$OUT/launch_cost.json" 2>&1 | grep -v Warn | tail -13
    gpu_tests 200
fi
if [ "$1" = 8 ]; then
    m27_wait
    for v in 16384:128:8 0:128:8 0:128:4 16384:128:8; do
        n=$((n + 1))
        IFS=: read -r wide t w <<< "$v"
        echo "HIVEJET_PACKED_WIDE_ROWS=$wide HIVEJET_DECODE_WAVES=$t:$w,64:8"
        HIVEJET_PACKED_WIDE_ROWS=$wide HIVEJET_DECODE_WAVES=$t:$w,64:8 timeout 80 python3 -u -m app.cli bench decode \
            -m /tmp/m27.gguf --depths 0 --rows 1 4 16 --json "$OUT/decode27b_wide${wide}_${w}_$n.json" 2>&1 \
            | grep -v Warn | tail -4
    done
    HIVEJET_PACKED_WIDE_ROWS=0 timeout 130 python3 -u .ci/gpu/matmul_shapes.py /tmp/m27.gguf \
        --json "$OUT/matmul_shapes_wide.json" 2>&1 | grep -v Warn | tail -12
fi
