#!/bin/bash
# The thirty-third session's calls. s32.sh 1 (H200) found the fixed PDL and the prompt pieces the same bits
# everywhere, so the prompt pieces and the rows kernel are on by default now. Carry .whl (run 2 also .bench-srv).
#   run 1: the GPU tests of the pieces, the rows kernel and the runner by default (the pieces on); then bench
#          agents, all five scenarios, with the new defaults.
#   run 2: llama-server's scenarios 1 and 3 (the same client) for the comparison in the same session.
source .ci/gpu/env.sh
OUT=$(realpath "$OUT")
m27_start
if [ "$1" = 1 ]; then
    TESTS_SECONDS=200 tests_into gpu_tests_defaults.txt tests/kernels/test_gdn_rows.py tests/kernels/test_pdl.py \
        tests/engine/test_runner_pieces.py tests/engine/test_runner_prefill.py tests/engine/test_runner.py \
        tests/engine/test_engine_runner.py -k "not smollm2 and not gemma3_real and not cuda_engine_matches_cpu_path"
    agents hivejet 330
fi
if [ "$1" = 2 ]; then
    agents llama.cpp 400 1 3
fi
