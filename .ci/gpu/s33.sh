#!/bin/bash
# The thirty-third session's calls. s32.sh 1 (H200) found the fixed PDL and the prompt pieces the same bits
# everywhere, so the prompt pieces and the rows kernel are on by default now. Carry .whl (run 3 also .bench-srv).
#   run 1: the GPU tests of the pieces, the rows kernel and the runner by default (the pieces on); then the
#          engine as on a 24 GiB card (engine24.py: its defaults, 16 slots, so the pass graphs are captured;
#          the pool fit now keeps them out of the KV pool): does it start and serve, and what is left free.
#   run 2: bench agents, all five scenarios, with the new defaults.
#   run 3: llama-server's scenarios 1 and 3 (the same client) for the comparison in the same session.
source .ci/gpu/env.sh
OUT=$(realpath "$OUT")
m27_start
if [ "$1" = 1 ]; then
    TESTS_SECONDS=${TESTS_SECONDS:-200} tests_into gpu_tests_defaults.txt tests/kernels/test_gdn_rows.py \
        tests/kernels/test_pdl.py tests/engine/test_runner_pieces.py tests/engine/test_runner_prefill.py \
        tests/engine/test_runner.py tests/engine/test_engine_runner.py \
        -k "not smollm2 and not gemma3_real and not cuda_engine_matches_cpu_path"
    m27_wait
    timeout 200 python3 -u .ci/gpu/engine24.py --json "$OUT/engine24.json" 2>&1 | grep -v Warn | tail -3
    HIVEJET_PROMPT_PIECES=0 timeout 150 python3 -u .ci/gpu/engine24.py --json "$OUT/engine24_nopieces.json" 2>&1 | grep -v Warn | tail -3
fi
if [ "$1" = 2 ]; then
    agents hivejet 500
fi
if [ "$1" = 3 ]; then
    agents llama.cpp 500 1 3
fi
