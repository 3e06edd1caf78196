#!/bin/bash
# Prepared in the twenty-sixth session (2026-12-04; carry .whl), not run: no device time was left.
#   run 1: the K/V rows written by one Triton kernel (HIVEJET_KV_WRITE_KERNEL=1, engine/runner_attention.py,
#          kernels/attention/kv_write.py; off by default until this measures it): its GPU test and the runner's
#          GPU tests with it on (graphs against eager, rows invariant, greedy against the CPU for qwen35), then
#          bench decode with it off / on, twice. If it is faster, make it the default (and bf16 with it: the GPU
#          rounds as torch does, test_rows_written_on_gpu checks it). Then the first 90 kernels of a replayed
#          1-row step in order (step_timeline.py --sequence, PDL off): which launches a layer makes.
source .ci/gpu/env.sh
OUT=$(realpath "$OUT")
m27_start
if [ "$1" = 1 ]; then
    HIVEJET_KV_WRITE_KERNEL=1 tests_into gpu_tests_kvw.txt tests/kernels/test_kv_write.py tests/engine/test_runner.py \
        -k "kv_write or graphs_equal_eager or (greedy_equals_cpu and qwen35) or stacked"
    bench kvw_off_1
    bench kvw_on_2 HIVEJET_KV_WRITE_KERNEL=1
    bench kvw_off_3
    bench kvw_on_4 HIVEJET_KV_WRITE_KERNEL=1
    # the order of one replayed 1-row step's first kernels (the first attention layer is the 4th), PDL off
    HIVEJET_PDL=0 timeout 120 python3 -u .ci/gpu/step_timeline.py /tmp/m27.gguf --rows 1 --sequence 90 \
        --json "$OUT/step_timeline_seq.json" 2>&1 | grep -v Warn | tail -12
fi
