#!/bin/bash
# The eighteenth session's GPU calls, carrying .whl (see README.md):
#   run 1: Nsight Compute on the gate+up stack (Q4_K 34816x5120) with and without a 128-register cap;
#          sweep_regs.py (register caps and 64-row tiles on every decode matrix); `bench
#          decode` at depth 0 without a cap / with HIVEJET_DECODE_MAXNREG=128:128 / without.
source .ci/gpu/env.sh
if [ "$1" = 1 ]; then
    m27_start
    bash .ci/gpu/ncu.sh gateup Q4_K 34816 5120
    bash .ci/gpu/ncu.sh gateup_r128 Q4_K 34816 5120 --maxnreg 128
    timeout 210 python3 -u .ci/gpu/sweep_regs.py --json "$OUT/sweep_regs.json" 2>&1 | grep -v Warn | tail -90
    m27_wait
    for v in "" 128:128 ""; do
        echo "HIVEJET_DECODE_MAXNREG=$v"
        HIVEJET_DECODE_MAXNREG=$v timeout 70 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --depths 0 \
            --rows 1 16 --json "$OUT/decode27b_regs${v/:/_}.json" 2>&1 | grep -v Warn | tail -4
    done
    exit
fi
#   run 2: the stall reasons of the three largest decode matrices (ncu_stalls.sh), and the gate+up stack's
#          stall samples and shared-memory wavefronts per SASS instruction (ncu_source.sh)
if [ "$1" = 2 ]; then
    bash .ci/gpu/ncu_source.sh gateup Q4_K 34816 5120
    bash .ci/gpu/ncu_stalls.sh gateup Q4_K 34816 5120
    bash .ci/gpu/ncu_stalls.sh down_q4 Q4_K 5120 17408
    bash .ci/gpu/ncu_stalls.sh down_q6 Q6_K 5120 17408
    bash .ci/gpu/ncu_stalls.sh gateup_16 Q4_K 34816 5120 --rows 16
fi
#   run 3 (and .bench-bin; the planes with each thread's bytes of a tile row side by side, fp16 matmul
#          inputs from their producers): GPU tests of the packed matmul, the fused kernels and the runner;
#          matmul_shapes.py with fp16 and float32 x; bench27b.sh with llama-bench
if [ "$1" = 3 ]; then
    m27_start
    timeout 210 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_packed.py \
        tests/kernels/test_fused.py tests/engine/test_runner.py \
        -k "not smollm2 and not gemma3_real and (not test_runner or fp16_matmul or graphs_equal_eager or greedy_equals_cpu or draft_steps)" \
        > "$OUT/gpu_tests_s18_3.txt" 2>&1
    grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests_s18_3.txt" | tail -12
    m27_wait
    timeout 110 python3 -u .ci/gpu/matmul_shapes.py /tmp/m27.gguf --x32 --json "$OUT/matmul_shapes.json" 2>&1 | grep -v Warn | tail -14
    timeout 230 bash .ci/gpu/bench27b.sh --rows 1 4 16 2>&1 | grep -v Warn | tail -14
fi
#   run 4: where the new kernel waits (ncu_source.sh, ncu_stalls.sh on the gate+up stack and a down
#          projection), the step's timeline, register caps again on the three largest shapes
if [ "$1" = 4 ]; then
    m27_start
    bash .ci/gpu/ncu_source.sh gateup2 Q4_K 34816 5120 | head -3
    bash .ci/gpu/ncu_stalls.sh gateup2 Q4_K 34816 5120
    bash .ci/gpu/ncu_stalls.sh down_q4_2 Q4_K 5120 17408
    timeout 100 python3 -u .ci/gpu/sweep_regs.py --shapes 3 --json "$OUT/sweep_regs2.json" 2>&1 | grep -v Warn | tail -30
    m27_wait
    timeout 90 python3 -u .ci/gpu/step_timeline.py /tmp/m27.gguf --json "$OUT/step_timeline.json" 2>&1 | grep -v Warn | tail -24
fi
#   run 5 (and .bench-bin; 128-row tiles capped at 128 registers by default): split-K and stages again on
#          the largest shapes (sweep_split_stages.py), then bench27b.sh with llama-bench
if [ "$1" = 5 ]; then
    m27_start
    timeout 110 python3 -u .ci/gpu/sweep_split_stages.py --json "$OUT/sweep_split_stages.json" 2>&1 | grep -v Warn | tail -40
    timeout 230 bash .ci/gpu/bench27b.sh --rows 1 4 16 2>&1 | grep -v Warn | tail -14
fi
#   run 6: `bench agents` with HiveJet, and the packed matmul's GPU tests
if [ "$1" = 6 ]; then
    m27_start
    agents hivejet 360
    timeout 100 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_packed.py > "$OUT/gpu_tests_s18_6.txt" 2>&1
    grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests_s18_6.txt" | tail -6
fi
#   run 7 (and .bench-bin; rows r and r + 8 paired in the fragment-order planes): GPU tests of the packed
#          matmul and the runner, then bench27b.sh with llama-bench
if [ "$1" = 7 ]; then
    m27_start
    timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_packed.py tests/engine/test_runner.py \
        -k "not smollm2 and not gemma3 and (not test_runner or fp16_matmul or graphs_equal_eager or greedy_equals_cpu)" \
        > "$OUT/gpu_tests_s18_7.txt" 2>&1
    grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests_s18_7.txt" | tail -8
    timeout 230 bash .ci/gpu/bench27b.sh --rows 1 4 16 2>&1 | grep -v Warn | tail -12
fi
#   run 8 (and .bench-bin; the row pairs stored in 16-byte chunks per thread, no bank conflicts): the packed
#          matmul's Q4_K / Q6_K GPU tests, then bench decode at depth 0 with llama-bench. NOT RUN: the session's
#          device time was spent; the layout it measures is in commit history only (the commit before its
#          removal), for the next session to check out and run
if [ "$1" = 8 ]; then
    m27_start
    timeout 50 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_packed.py -k "Q4_K or Q6_K" \
        > "$OUT/gpu_tests_s18_8.txt" 2>&1
    grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests_s18_8.txt" | tail -6
    m27_wait
    tar xJf .bench-bin/llama-bench-b11434-cuda-sm90.tar.xz -C /tmp
    timeout 100 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --llamacpp /tmp --depths 0 --rows 1 16 \
        --json "$OUT/decode27b.json" 2>&1 | grep -v Warn | tail -8
fi
