#!/bin/bash
# The 4-bit plane in tensor-core fragment order, its nibbles to fp16 by PTX (written in the fourteenth
# session, run in the fifteenth), carrying .whl and .bench-bin: the packed matmul's GPU tests, the Q4_K
# settings at 128-value tiles (sweep_tile_k.py --q4), then `bench decode` with llama-bench.
source .ci/gpu/env.sh
m27_start
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_packed.py > "$OUT/gpu_tests_packed.txt" 2>&1
grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests_packed.txt" | head -12
timeout 170 python3 -u .ci/gpu/sweep_tile_k.py --q4 --json "$OUT/sweep_tile_k_q4.json" 2>&1 | grep -v Warn | grep "M= 1"
m27_wait
timeout 270 bash .ci/gpu/bench27b.sh --rows 1 4 16 2>&1 | grep -v Warn | tail -14
