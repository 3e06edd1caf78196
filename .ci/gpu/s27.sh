#!/bin/bash
# Prepared in the twenty-sixth session (2026-12-04; carry .whl), not run: no device time was left.
#   run 1: the K/V rows written by one Triton kernel (HIVEJET_KV_WRITE_KERNEL=1, engine/runner_attention.py,
#          kernels/attention/kv_write.py; off by default until this measures it): its GPU test and the runner's
#          GPU tests with it on (graphs against eager, rows invariant, greedy against the CPU for qwen35), then
#          bench decode with it off / on, twice. If it is faster, make it the default (and bf16 with it: the GPU
#          rounds as torch does, test_rows_written_on_gpu checks it). Then the first 90 kernels of a replayed
#          1-row step in order (step_timeline.py --sequence, PDL off): which launches a layer makes.
#   run 2: measured run 1 made the K/V-write kernel the default; then the fused per-head kernels (q/k norms + rope
#          + the K/V write in one launch for decode rows over a float cache, the DeltaNet's output norm with its
#          SiLU gate in one launch, no fill kernels for placeholder arguments): their GPU tests, bench decode
#          with them / HIVEJET_FUSED_HEADS=0, twice, and the new step's first kernels in order.
#   run 3: the embedding rows by one Triton launch (packed_rows_triton) and qwen35's attention output gate in the
#          decode attention's merge kernel (under HIVEJET_FUSED_HEADS): the GPU tests of the kernels and the
#          runner, bench decode by default / HIVEJET_ROWS_KERNEL=0, twice, then the whole `bench decode` (depths 0
#          and 23000, rows 1..64) with llama-bench in the same run.
#   run 4: issue #6's agents on the new step: HiveJet scenarios 1 and 2, llama-server scenario 1 (carry .bench-srv).
#   run 5: decode steps of more than 16 rows in blocks of up to 64 rows of x (wide_decode_rows): the GPU tests
#          of the packed matmul (every row's bits as alone) and the runner's invariance, then bench decode
#          rows 1..64 with it and with HIVEJET_DECODE_BLOCK_M=16 (as before).
#   run 6: after run 5, wide blocks kept to the swap_ab settings without TMA (Q8_0 rows differed, TMA tiles ran out of
#          shared memory): the packed matmul's GPU tests again.
#   run 7: the final code: bench decode at 1 / 4 / 16 rows and the traced step's kernels (PDL off).
# (Runs 1 and 2 switch off what later runs added, so that they measure on today's code what they measured then.)
source .ci/gpu/env.sh
OUT=$(realpath "$OUT")
m27_start
# the first 90 kernels of one replayed 1-row step in order (the first attention layer is the 4th), PDL off, into
# $OUT/NAME.json: `kernel_sequence NAME`
kernel_sequence() {
    m27_wait
    HIVEJET_PDL=0 timeout 120 python3 -u .ci/gpu/step_timeline.py /tmp/m27.gguf --rows 1 --sequence 90 \
        --json "$OUT/$1.json" 2>&1 | grep -v Warn | tail -14
}
if [ "$1" = 1 ]; then
    HIVEJET_FUSED_HEADS=0 tests_into gpu_tests_kvw.txt tests/kernels/test_kv_write.py tests/engine/test_runner.py \
        -k "kv_write or graphs_equal_eager or (greedy_equals_cpu and qwen35) or stacked"
    bench kvw_off_1 HIVEJET_KV_WRITE_KERNEL=0 HIVEJET_ROWS_KERNEL=0
    bench kvw_on_2 HIVEJET_FUSED_HEADS=0 HIVEJET_ROWS_KERNEL=0
    bench kvw_off_3 HIVEJET_KV_WRITE_KERNEL=0 HIVEJET_ROWS_KERNEL=0
    bench kvw_on_4 HIVEJET_FUSED_HEADS=0 HIVEJET_ROWS_KERNEL=0
    kernel_sequence step_timeline_seq
fi
if [ "$1" = 2 ]; then
    TESTS_SECONDS=260 tests_into gpu_tests_fused.txt tests/kernels/test_kv_write.py tests/kernels/test_fused.py \
        tests/engine/test_runner.py -k "not smollm2 and not gemma3_real and not every_cache_type"
    bench fused_1 HIVEJET_ROWS_KERNEL=0
    bench sep_2 HIVEJET_FUSED_HEADS=0 HIVEJET_ROWS_KERNEL=0
    bench fused_3 HIVEJET_ROWS_KERNEL=0
    bench sep_4 HIVEJET_FUSED_HEADS=0 HIVEJET_ROWS_KERNEL=0
    kernel_sequence step_timeline_seq_fused
fi
if [ "$1" = 3 ]; then
    TESTS_SECONDS=300 tests_into gpu_tests_3.txt tests/kernels/test_packed.py tests/kernels/test_attention.py \
        tests/kernels/test_kv_write.py tests/kernels/test_fused.py tests/engine/test_runner.py \
        -k "not smollm2 and not gemma3_real and not (greedy_equals_cpu and gemma3)"
    bench rows_1
    bench torchrows_2 HIVEJET_ROWS_KERNEL=0
    bench rows_3
    bench torchrows_4 HIVEJET_ROWS_KERNEL=0
    tar xJf .bench-bin/llama-bench-b11434-cuda-sm90.tar.xz -C /tmp
    timeout 240 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --llamacpp /tmp --json "$OUT/decode27b_full.json" \
        2>&1 | grep -v Warn | tail -16
fi
if [ "$1" = 4 ]; then
    agents hivejet 300 1 2
    agents llama.cpp 200 1
fi
if [ "$1" = 5 ]; then
    TESTS_SECONDS=250 tests_into gpu_tests_5.txt tests/kernels/test_packed.py tests/engine/test_runner.py \
        -k "wide_decode or tma_on_gpu or split_sums_in_the_kernel_on_gpu or graphs_equal_eager or stacked_weights \
            or (greedy_equals_cpu and qwen35) or draft_steps_as_graphs"
    m27_wait
    for run in wide_1:64 narrow_2:16 wide_3:64; do
        echo "${run%%:*}"
        HIVEJET_DECODE_BLOCK_M=${run##*:} timeout 100 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --depths 0 \
            --json "$OUT/decode27b_${run%%:*}.json" 2>&1 | grep -v Warn | tail -8
    done
fi
if [ "$1" = 6 ]; then
    TESTS_SECONDS=240 tests_into gpu_tests_6.txt tests/kernels/test_packed.py
fi
if [ "$1" = 7 ]; then
    bench final
    kernel_sequence step_timeline_seq_final
fi
