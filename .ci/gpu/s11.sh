#!/bin/bash
# The eleventh session's GPU call (carrying .whl and .bench-bin): the packed layout with 8-bit scale
# codes and per-256 d/dmin (kernels/quant/packed.py): the packed-matmul GPU tests, the GPU runner tests
# on synthetic models (quantized stacks included), then `bench decode` on the synthetic 27B with
# llama-bench in the same run (bench27b.sh).
source .ci/gpu/env.sh
m27_start
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_packed.py 2>&1 | tail -6
timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_runner.py \
    -k "not smollm2 and not gemma3_real" --deselect "tests/engine/test_runner.py::test_gpu_greedy_equals_cpu[gemma3]" \
    2>&1 | tail -6
bash .ci/gpu/bench27b.sh "$@" 2>&1 | grep -v Warn | tail -30
