#!/bin/bash
# The nineteenth session's GPU calls, carrying .whl (see README.md). NOT RUN in that session: its device time
# was spent before it began (189 s left, too little to start a machine). For the next session:
#   run 1: the GPU tests against the CPU references, which now compute their elementwise ops, reductions and
#          attention in float64 (docs/ACCURACY.md, 2026-12-03): the fused kernels, the runner (greedy GPU
#          output against the CPU path, every cache type) and the engine on the runner
#   run 2 (and .bench-bin; check out 3cfb33f first: the row pairs stored in 16-byte chunks per thread): what
#          s18.sh 8 was to measure, the packed matmul's Q4_K / Q6_K GPU tests and bench decode with llama-bench
source .ci/gpu/env.sh
if [ "$1" = 1 ]; then
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_fused.py \
        tests/kernels/test_attention.py tests/kernels/test_gdn.py > "$OUT/gpu_tests_s19_1a.txt" 2>&1
    grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests_s19_1a.txt" | tail -8
    gpu_tests 300
fi
if [ "$1" = 2 ]; then
    bash .ci/gpu/s18.sh 8
fi
