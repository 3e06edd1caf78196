#!/bin/bash
# The thirty-fourth session's calls. Carry .whl.
#   run 1: state checkpoints in host memory. The GPU tests of prefix sharing (the new one: pinned host
#          checkpoints give a cold engine's tokens and logprobs, as device ones do); then the engine as on a
#          24 GiB card (engine24.py): by default (the checkpoints go to host memory there), and with none (the
#          behaviour before: nothing fit on the device). Each regenerates the 20K prompt and follows it up with
#          the reply's first tokens dropped; what the first token takes, how much was reused, and what the
#          host copies cost the 20K prompt.
#   run 2: bench agents, all five scenarios, with the defaults.
source .ci/gpu/env.sh
OUT=$(realpath "$OUT")
m27_start
if [ "$1" = 1 ]; then
    TESTS_SECONDS=${TESTS_SECONDS:-200} tests_into gpu_tests_prefix.txt tests/engine/test_runner_prefix.py \
        tests/engine/test_engine_runner.py -k "not smollm2 and not gemma3_real and not cuda_engine_matches_cpu_path"
    m27_wait
    timeout 200 python3 -u .ci/gpu/engine24.py --json "$OUT/engine24_host.json" 2>&1 | grep -v Warn | tail -3
    timeout 200 python3 -u .ci/gpu/engine24.py --checkpoints 0 --json "$OUT/engine24_nockpt.json" 2>&1 | grep -v Warn | tail -3
fi
if [ "$1" = 2 ]; then
    agents hivejet 500
fi
