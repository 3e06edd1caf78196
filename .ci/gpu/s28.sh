#!/bin/bash
# The twenty-eighth session's calls (2026-12-04; carry .whl, run 4 also .bench-bin, run 5 .bench-srv), each on the
# working tree of the moment; run 1 was prepared in the twenty-seventh session. docs/PERFORMANCE.md has the results.
#   run 1: decode steps of more than 16 rows (wide_decode_rows, kernels/quant/packed.py) with more warps. Compiled for
#          sm_90 here (.ci/gpu/sass_stats.py --block-m), 64-row blocks of x on 128-row Q4_K / Q6_K tiles take 255
#          registers and spill ~740 bytes at 4 warps, 243-245 registers at 8; 32-row blocks at 8 warps take 128, 64-row
#          blocks on 64-row tiles at 8 warps 125. First the invariance tests under each setting (a row's bits as in a
#          1-row step: more warps may change them, then that setting is out), then bench decode rows 1..64 with
#          the default (64-row blocks, the weight's warps), 8 warps (HIVEJET_DECODE_WIDE_WARPS=8), and 32-row blocks
#          at 8 warps. Keep the fastest setting whose tests pass.
#   run 2: the decode attention's fewest keys per split-K program for float caches (FLOAT_DECODE_CONFIG min_keys
#          256: a row under 256 keys runs on one program per KV head, 13 us a layer at 256 keys in the s27 trace):
#          sweep_attn.py --short (contexts 128..4096, 1-16 rows), then bench decode at depths 0 and 23000 with
#          min_keys 256 / 64 / 128 (through a switch HIVEJET_ATTN_MIN_KEYS made for this run, not kept: the
#          sweep chose a split by row length instead, short_keys, run 3).
#   run 3: short rows in about 8 programs of at least 64 keys (FLOAT_DECODE_CONFIG short_keys): the GPU tests of
#          the attention and the runner, bench decode at depths 0 and 23000 with it, without
#          (HIVEJET_ATTN_SHORT_KEYS=0) and with it again, and the 1-row step's kernels (step_timeline.py).
#   run 4: the final code: bench decode with llama-bench in the same run (carry .bench-bin), then the runner's
#          overlapped-step GPU tests and the attention's split tests (run 3's 200 s ran out before the first).
#   run 6: sweep_attn.py --short on the final code: short_keys 64 (the default) against none (0) and 128, on
#          more cases (1-16 rows of 128 to 4096 keys).
#   run 7 (prepared, not run: no GPU was lent for it): the delta rule of small prompt chunks in one launch
#          (kernels/gdn/rows.py, off until measured: HIVEJET_GDN_ROWS_KERNEL=1): its GPU tests and the qwen35
#          runner's against the CPU with it on, then prefill_profile.py 32 256 (a 32-token prompt's 64-row pass)
#          with it and without, then bench agents scenario 1 with it. If the tests pass and the pass is faster,
#          make it the default (ROWS_KERNEL_ON).
#   run 5: issue #6's agents on the final code: HiveJet scenarios 1 and 2, llama-server scenario 1 (carry
#          .bench-srv; both llama.cpp tars together pass a call's 64 MiB).
source .ci/gpu/env.sh
OUT=$(realpath "$OUT")
m27_start
if [ "$1" = 1 ]; then
    for s in "HIVEJET_DECODE_WIDE_WARPS=8" "HIVEJET_DECODE_WIDE_WARPS=8 HIVEJET_DECODE_BLOCK_M=32"; do
        echo "$s"
        env $s timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_packed.py \
            -k "wide_decode or split_sums_in_the_kernel_on_gpu" 2>&1 | tail -2
    done
    m27_wait
    for run in "default:" "warps8:HIVEJET_DECODE_WIDE_WARPS=8" "warps8_m32:HIVEJET_DECODE_WIDE_WARPS=8 HIVEJET_DECODE_BLOCK_M=32"; do
        echo "${run%%:*}"
        env ${run#*:} timeout 100 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --depths 0 \
            --json "$OUT/decode27b_${run%%:*}.json" 2>&1 | grep -v Warn | tail -8
    done
fi
if [ "$1" = 2 ]; then
    timeout 150 python3 -u .ci/gpu/sweep_attn.py 110 --short 2>&1 | grep -E "^top|^\{|skip"
    m27_wait
    for mk in 256 64 128; do
        echo "min_keys $mk"
        HIVEJET_ATTN_MIN_KEYS=$mk timeout 120 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --depths 0 23000 \
            --rows 1 4 16 --json "$OUT/decode27b_mk$mk.json" 2>&1 | grep -v Warn | tail -12
    done
fi
if [ "$1" = 3 ]; then
    TESTS_SECONDS=200 tests_into gpu_tests.txt tests/kernels/test_attention.py tests/engine/test_runner.py \
        tests/engine/test_engine_runner.py -k "not smollm2 and not gemma3_real and not (greedy_equals_cpu and gemma3)"
    m27_wait
    for run in "short:" "long:HIVEJET_ATTN_SHORT_KEYS=0" "short2:"; do
        echo "${run%%:*}"
        env ${run#*:} timeout 120 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --depths 0 23000 \
            --rows 1 4 16 --json "$OUT/decode27b_${run%%:*}.json" 2>&1 | grep -v Warn | tail -11
    done
    timeout 90 python3 -u .ci/gpu/step_timeline.py /tmp/m27.gguf --rows 1 --sequence 60 \
        --json "$OUT/step_timeline.json" 2>&1 | grep -v Warn | head -30
fi
if [ "$1" = 4 ]; then
    m27_wait
    tar xJf .bench-bin/llama-bench-b11434-cuda-sm90.tar.xz -C /tmp
    timeout 240 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --llamacpp /tmp --json "$OUT/decode27b_full.json" \
        2>&1 | grep -v Warn | tail -16
    TESTS_SECONDS=150 tests_into gpu_tests.txt tests/engine/test_engine_runner.py tests/kernels/test_attention.py \
        -k "overlapped_steps_give or short or split"
fi
if [ "$1" = 5 ]; then
    agents hivejet 300 1 2
    agents llama.cpp 200 1
fi
if [ "$1" = 6 ]; then
    timeout 220 python3 -u .ci/gpu/sweep_attn.py 150 --short 2>&1 | grep -E "^top|^\{|skip"
fi
if [ "$1" = 7 ]; then
    m27_start
    HIVEJET_GDN_ROWS_KERNEL=1 TESTS_SECONDS=150 tests_into gpu_tests_7.txt tests/kernels/test_gdn_rows.py \
        tests/engine/test_runner.py tests/engine/test_runner_prefill.py \
        -k "rows_kernel or (greedy_equals_cpu and qwen35) or (every_cache_type and qwen35) or captured"
    m27_wait
    for run in "on:HIVEJET_GDN_ROWS_KERNEL=1" "off:"; do
        echo "${run%%:*}"
        mkdir -p "$OUT/${run%%:*}"
        env ${run#*:} OUT="$OUT/${run%%:*}" timeout 50 python3 -u .ci/gpu/prefill_profile.py /tmp/m27.gguf 32 256 2>&1 \
            | grep -E "^depth|delta_rows|trsm"
    done
    HIVEJET_GDN_ROWS_KERNEL=1 agents hivejet 90 1
fi
