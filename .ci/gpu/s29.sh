#!/bin/bash
# The twenty-ninth session's prepared calls (2026-12-04; no GPU was lent in the session: none has run yet).
# Carry .whl. docs/PERFORMANCE.md (twenty-ninth session) says what each is for and what would follow.
#   run 1: several slots' short prompt pieces in one padded pass (Runner.prefill_pieces; off until measured:
#          HIVEJET_PROMPT_PIECES=1, which needs HIVEJET_GDN_ROWS_KERNEL=1 for qwen35's delta rule of all pieces
#          in one launch, kernels/gdn/rows.py: delta_rule_pieces). First the GPU tests of both with them on (the
#          captured passes against their own prefills bit for bit, the kernels against the recurrence), then
#          pieces_timing.py (k = 1..16 prompts of 32 tokens: one pass each against one pass for all; the
#          graphs' memory) with both on, with the rows kernel alone, and with neither (today's default).
#   run 2: bench agents scenario 1 with both on, then with the rows kernel alone (s28.sh run 7's last part).
#          Against s28 run 5 (446 / 775 / 1212 tok/s for 4 / 8 / 16 agents; first tokens up to 0.13 / 0.24 /
#          0.48 s). If run 1's tests pass and both runs are faster, turn both on by default (PROMPT_PIECES_ON in
#          engine/runner.py, ROWS_KERNEL_ON in kernels/gdn/rows.py) and add the pass graphs' memory to the
#          planner's CUDA_GRAPH_BYTES.
source .ci/gpu/env.sh
OUT=$(realpath "$OUT")
m27_start
ON="HIVEJET_PROMPT_PIECES=1 HIVEJET_GDN_ROWS_KERNEL=1"
if [ "$1" = 1 ]; then
    (export $ON TESTS_SECONDS=170; tests_into gpu_tests_1.txt tests/kernels/test_gdn_rows.py \
        tests/engine/test_runner_pieces.py tests/engine/test_runner_prefill.py tests/engine/test_runner.py \
        -k "rows_kernel or pieces or captured or (greedy_equals_cpu and qwen35) or (every_cache_type and qwen35)")
    m27_wait
    for run in "both:$ON" "rows:HIVEJET_GDN_ROWS_KERNEL=1" "off:"; do
        echo "${run%%:*}"
        mkdir -p "$OUT/${run%%:*}"
        env ${run#*:} OUT="$OUT/${run%%:*}" timeout 110 python3 -u .ci/gpu/pieces_timing.py /tmp/m27.gguf 32 512 \
            2>&1 | grep -v Warn | tail -7
    done
fi
if [ "$1" = 2 ]; then
    m27_wait
    (export $ON; agents hivejet 200 1)      # (shell functions: the switches exported in a subshell)
    mv "$OUT/agents_hivejet.json" "$OUT/agents_hivejet_pieces.json"
    (export HIVEJET_GDN_ROWS_KERNEL=1; agents hivejet 200 1)
fi
