#!/bin/bash
# The eleventh session's first and third GPU calls (carrying .whl and .bench-bin): the packed-matmul GPU tests (both
# scale layouts), the GPU runner tests, then `bench decode` with llama-bench (default layout: fp16 scale
# products, no stored min for Q6_K).
source .ci/gpu/env.sh
m27_start
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_packed.py 2>&1 | tail -4
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_runner.py \
    -k "not smollm2 and not gemma3_real" --deselect "tests/engine/test_runner.py::test_gpu_greedy_equals_cpu[gemma3]" \
    2>&1 | grep -E "^E .*(center|assert)|passed|failed" | head -12
bash .ci/gpu/bench27b.sh 2>&1 | grep -v Warn | tail -18
