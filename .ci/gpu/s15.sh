#!/bin/bash
# The fifteenth session's GPU calls, carrying .whl (and .bench-bin for `bench decode`):
#   run 1: the high-plane settings at 128-value tiles with the fragment-order 4-bit plane, its PTX
#          extraction on and off (sweep_tile_k.py --hi), then `bench decode` at depth 0 with it off;
#   run 2: the GPU tests of the packed matmul, codecs, attention, runner, prompt chunks and engine, then
#          `bench decode` with llama-bench (rows 1, 4, 16);
#   run 3: split-K counts and tile rows (sweep_tile_k.py --split), then `bench agents` (HiveJet; it
#          failed: fastapi needs opentelemetry-api, now in .whl);
#   run 4 (and .bench-bin): `bench decode` with llama-bench (8 programs per SM for 128-row tiles), then
#          `bench agents` (HiveJet);
#   run 5: Q6_K's 2-bit high plane in fragment order too: the K-quant GPU tests of the packed matmul, the
#          high-plane sweep, then every decode matrix timed alone (matmul_shapes.py).
source .ci/gpu/env.sh
m27_start
if [ "$1" = 1 ]; then
    timeout 120 python3 -u .ci/gpu/sweep_tile_k.py --hi --json "$OUT/sweep_hi_ptx.json" 2>&1 | grep -v Warn | grep "M= 1"
    HIVEJET_NIBBLES_PTX=0 timeout 120 python3 -u .ci/gpu/sweep_tile_k.py --hi --json "$OUT/sweep_hi_noptx.json" 2>&1 | grep -v Warn | grep "M= 1"
    HIVEJET_NIBBLES_PTX=0 timeout 200 bash .ci/gpu/bench27b.sh --depths 0 --rows 1 16 2>&1 | grep -v Warn | tail -9
elif [ "$1" = 2 ]; then
    gpu_tests 280
    timeout 290 bash .ci/gpu/bench27b.sh --rows 1 4 16 2>&1 | grep -v Warn | tail -14
elif [ "$1" = 5 ]; then
    timeout 80 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_packed.py -k "Q6_K or Q5_K or Q4_K" \
        > "$OUT/gpu_tests_packed.txt" 2>&1
    grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests_packed.txt" | head -8
    timeout 70 python3 -u .ci/gpu/sweep_tile_k.py --hi --json "$OUT/sweep_hi.json" 2>&1 | grep -v Warn | grep "M= 1"
    m27_wait
    timeout 65 python3 -u .ci/gpu/matmul_shapes.py /tmp/m27.gguf --json "$OUT/matmul_shapes.json" 2>&1 | grep -v Warn | tail -13
elif [ "$1" = 4 ]; then
    timeout 200 bash .ci/gpu/bench27b.sh --rows 1 4 16 2>&1 | grep -v Warn | tail -14
    agents hivejet 340
else
    timeout 200 python3 -u .ci/gpu/sweep_tile_k.py --split --json "$OUT/sweep_split.json" 2>&1 | grep -v Warn | grep "M= 1"
    agents hivejet 330
fi
