#!/bin/bash
# The thirty-fifth session's calls. Carry .whl, and .bench-bin for run 2 / .bench-srv for run 3. What ran
# (2026-12-05, an H100 80GB, docs/PERFORMANCE.md thirty-fifth section): run 1 with INLINE=1, then run 1, both at
# 5b0955c (the prefetch code is gone since: slower both ways), then runs 2 and 3, then llama-server's scenarios
# 2-5 (`agents llama.cpp 480 2 3 4 5`).
#   run 1: the output projections' weights asked into L2 right after the input projection
#          (HIVEJET_PREFETCH_AHEAD, kernels/quant/prefetch.py): its GPU tests (the kernel changes nothing, the
#          decode logits are the same bits with it), then `bench decode` at 1 / 4 / 16 rows off / aside / off /
#          aside, aside with 256 B and 4 KB pieces (INLINE=1: the kernel in the step's stream instead, 4 KB pieces
#          twice, then 1 KB and 16 KB)
#   run 2: `bench decode` with llama-bench in the same call (depths 0 and 23000, rows 1..64), PREFETCH set by
#          the caller (the default otherwise)
#   run 3: bench agents, all five scenarios, with the defaults; then llama-server's scenario 1
#   run 4: text chunks of image prompts through the padded pass's graphs: the vision GPU tests, the prompt
#          chunks' and pieces' GPU tests, the runner's graph and greedy tests
source .ci/gpu/env.sh
OUT=$(realpath "$OUT")
m27_start
if [ "$1" = 1 ]; then
    TESTS_SECONDS=150 tests_into gpu_tests_prefetch.txt tests/kernels/test_prefetch.py tests/engine/test_runner.py \
        -k "prefetch or fp16_matmul or graphs_equal"
    if [ -n "$INLINE" ]; then   # (the first form, at 4 KB pieces: H100, 9.03 -> 9.38 ms a 1-row step)
        bench off HIVEJET_PREFETCH_AHEAD=0
        bench on HIVEJET_PREFETCH_AHEAD=1 HIVEJET_PREFETCH_PIECE=4096
        bench off2 HIVEJET_PREFETCH_AHEAD=0
        bench on2 HIVEJET_PREFETCH_AHEAD=1 HIVEJET_PREFETCH_PIECE=4096
        bench on_1k HIVEJET_PREFETCH_AHEAD=1 HIVEJET_PREFETCH_PIECE=1024
        bench on_16k HIVEJET_PREFETCH_AHEAD=1 HIVEJET_PREFETCH_PIECE=16384
    else
        bench off HIVEJET_PREFETCH_AHEAD=0
        bench aside HIVEJET_PREFETCH_AHEAD=2
        bench off2 HIVEJET_PREFETCH_AHEAD=0
        bench aside2 HIVEJET_PREFETCH_AHEAD=2
        bench aside_256 HIVEJET_PREFETCH_AHEAD=2 HIVEJET_PREFETCH_PIECE=256
        bench aside_4k HIVEJET_PREFETCH_AHEAD=2 HIVEJET_PREFETCH_PIECE=4096
    fi
fi
if [ "$1" = 2 ]; then
    m27_wait
    tar xJf .bench-bin/llama-bench-*.tar.xz -C /tmp
    env ${PREFETCH:+HIVEJET_PREFETCH_AHEAD=$PREFETCH} timeout 300 python3 -u -m app.cli bench decode \
        -m /tmp/m27.gguf --llamacpp /tmp --json "$OUT/decode27b_llamacpp.json" 2>&1 \
        | grep -v Warn | tail -24
fi
if [ "$1" = 4 ]; then
    TESTS_SECONDS=400 tests_into gpu_tests_vision.txt tests/engine/test_vision_runner.py \
        tests/engine/test_runner_prefill.py tests/engine/test_runner_pieces.py tests/engine/test_runner.py \
        -k "not smollm2 and not gemma3_real and not equals_cpu[gemma3]"
fi
if [ "$1" = 3 ]; then
    agents hivejet 330
    agents llama.cpp 200 1
fi
