#!/bin/bash
# The thirty-second session's calls. s30.sh 3 and 4 (run on an H100) found PDL's race in the packed matmul's L2
# prefetch in 64-row blocks (the small prompt's and the wide decode steps' settings): .ci/gpu/pdl_isolate.py.
# Carry .whl (run 2 also .bench-bin).
#   run 1: the PDL GPU tests (with the fix: no prefetch past 16-row blocks); the 27B's prefill again with PDL on
#          and the prompt pieces on (prefill_repeat.py: the same bits in every path, and each piece as alone?);
#          with BENCH=1 bench decode with PDL on. With CONFIGS=1 first pdl_isolate.py configs: which settings the
#          prefetch breaks when forced into every block size, as before the fix (left out: device time was short).
#   run 2: with PDL on by default (if run 1 holds), the whole bench decode beside llama-bench (bench27b.sh).
source .ci/gpu/env.sh
OUT=$(realpath "$OUT")
m27_start
if [ "$1" = 1 ]; then
    [ -n "$CONFIGS" ] && timeout 120 python3 -u .ci/gpu/pdl_isolate.py 10 configs 2>&1 | grep -v Warn | tail -12
    TESTS_SECONDS=${TESTS_SECONDS:-120} tests_into gpu_tests_pdl.txt tests/kernels/test_pdl.py
    m27_wait
    mkdir -p "$OUT/repeat_pdl"
    # (PDL on, the default again; with the prompt pieces and the rows kernel on, so that the same run also says
    # whether a piece gets the bits its prompt gets alone, which the thirtieth session's race hid)
    HIVEJET_PDL=1 HIVEJET_PROMPT_PIECES=1 HIVEJET_GDN_ROWS_KERNEL=1 OUT="$OUT/repeat_pdl" timeout 100 \
        python3 -u .ci/gpu/prefill_repeat.py /tmp/m27.gguf 32 2>&1 \
        | grep -v Warn | tr -d " \n" | sed "s/},/},\n/g" | grep -E "again|first_diff|pieces|slot1|after"; echo
    [ -n "$BENCH" ] && bench pdl HIVEJET_PDL=1   # (left out when device time was short: the fix leaves 1-16-row steps as they were)
fi
if [ "$1" = 2 ]; then
    bash .ci/gpu/bench27b.sh 2>&1 | grep -v Warn | tail -40
fi
