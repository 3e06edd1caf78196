#!/bin/bash
# The twentieth session's GPU calls, carrying .whl (see README.md).
#   run 1: GPU tests of the small prompt chunks (64 rows through the packed matmul: kernels/quant/packed.py
#          small_prompt, engine/runner.py chunk_rows) and of the CPU references moved to float64 in the
#          nineteenth session (s19.sh 1's first half); then small_prompt.py: the 27B's matmuls at 64 rows
#          per setting (the pick -> $OUT/small_pick.json) and short prompts through the 64- and 256-row graphs
#   run 2: `bench agents` with HiveJet (the defaults then hold run 1's pick), then the rest of the GPU tests
source .ci/gpu/env.sh
if [ "$1" = 1 ]; then
    m27_start
    timeout 230 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_packed.py \
        tests/engine/test_runner_prefill.py tests/kernels/test_fused.py tests/kernels/test_attention.py \
        tests/kernels/test_gdn.py tests/engine/test_runner.py \
        -k "small_prompt or prefill_matmul or captured_chunks or test_fused or test_attention or test_gdn or greedy_equals_cpu" \
        > "$OUT/gpu_tests_s20_1.txt" 2>&1
    grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests_s20_1.txt" | tail -12
    m27_wait
    timeout 280 python3 -u .ci/gpu/small_prompt.py /tmp/m27.gguf --seconds 110 --json "$OUT/small_prompt.json" \
        --pick "$OUT/small_pick.json" 2>&1 | grep -v Warn | tail -30
fi
if [ "$1" = 2 ]; then
    m27_start
    agents hivejet 400
    gpu_tests 150
fi
# What the session ran after run 1 (the device's calls, in order; the pick of run 1 became the default in
# between, so the exports below are no longer needed):
#   run 2 (twice; the first stopped at fastapi 0.165's opentelemetry import: carry fastapi 0.115.14 and
#          starlette 0.46.2 instead): export HIVEJET_SMALL_PROMPT_CONFIG=<run 1's pick>; agents hivejet 430;
#          gpu_tests 120
#   then:  gpu_tests 300; python3 -u .ci/gpu/prefill_profile.py /tmp/m27.gguf 32 256
#   then:  python3 -u .ci/gpu/gc_check.py; the runner / prompt-chunk / engine / packed GPU tests (twice)
#   last:  bench agents --scenarios 4 --serve-args "--prefill-chunk 512" (docs/PERFORMANCE.md)
