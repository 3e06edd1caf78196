#!/bin/bash
# For the next session with device time, carrying .whl (see s21.sh) and, for run 3, .bench-srv:
#   run 1: the GPU tests after capture_guard's one-collect-per-batch change (7629e2c, not run on the GPU), with
#          test_captures_survive_dead_runners_graphs first, then the engine-wide set
#   run 2: the row-pair layout of commit 3cfb33f (check it out first): `s19.sh 2`
#   run 3: llama-server's scenarios 1-3 and 5 (`SCEN="1 2 3" s21.sh 3`, then SCEN=5), never re-run since the
#          thirteenth session
source .ci/gpu/env.sh
if [ "$1" = 1 ]; then
    timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/engine/test_runner.py \
        -k "captures_survive or graphs_equal_eager" 2>&1 | tail -3
    gpu_tests 400
fi
if [ "$1" = 2 ]; then
    bash .ci/gpu/s19.sh 2
fi
if [ "$1" = 3 ]; then
    SCEN="${SCEN:-1 2 3}" bash .ci/gpu/s21.sh 3
fi
