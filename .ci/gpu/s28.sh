#!/bin/bash
# Prepared in the twenty-seventh session (2026-12-04; carry .whl), not run: no device time was left.
#   run 1: decode steps of more than 16 rows (wide_decode_rows, kernels/quant/packed.py) with more warps. Compiled for
#          sm_90 here (.ci/gpu/sass_stats.py --block-m), 64-row blocks of x on 128-row Q4_K / Q6_K tiles take 255
#          registers and spill ~740 bytes at 4 warps, 243-245 registers at 8; 32-row blocks at 8 warps take 128, 64-row
#          blocks on 64-row tiles at 8 warps 125. First the invariance tests under each setting (a row's bits as in a
#          1-row step: more warps may change them, then that setting is out), then bench decode rows 1..64 with
#          the default (64-row blocks, the weight's warps), 8 warps (HIVEJET_DECODE_WIDE_WARPS=8), and 32-row blocks
#          at 8 warps. Keep the fastest setting whose tests pass.
source .ci/gpu/env.sh
OUT=$(realpath "$OUT")
m27_start
if [ "$1" = 1 ]; then
    for s in "HIVEJET_DECODE_WIDE_WARPS=8" "HIVEJET_DECODE_WIDE_WARPS=8 HIVEJET_DECODE_BLOCK_M=32"; do
        echo "$s"
        env $s timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_packed.py \
            -k "wide_decode or split_sums_in_the_kernel_on_gpu" 2>&1 | tail -2
    done
    m27_wait
    for run in "default:" "warps8:HIVEJET_DECODE_WIDE_WARPS=8" "warps8_m32:HIVEJET_DECODE_WIDE_WARPS=8 HIVEJET_DECODE_BLOCK_M=32"; do
        echo "${run%%:*}"
        env ${run#*:} timeout 100 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --depths 0 \
            --json "$OUT/decode27b_${run%%:*}.json" 2>&1 | grep -v Warn | tail -8
    done
fi
