#!/bin/bash
# The thirteenth session's GPU calls (128-value tiles along K the default), carrying .whl:
#   run 1 (and .bench-bin): the high-plane weights' settings at 128-value tiles (sweep_tile_k.py --hi),
#          then `bench decode` with llama-bench;
#   run 2: the GPU tests of the packed matmul, codecs, attention, runner and prompt chunks, then
#          `bench agents` (HiveJet);
#   run 3 (and .bench-bin): `bench decode` again after a change of settings;
#   run 4 (and .bench-srv): the CUDA time per kernel of one eager step (1 and 16 rows), then `bench agents`
#          with llama-server.
source .ci/gpu/env.sh
m27_start
TESTS="tests/kernels/test_packed.py tests/kernels/test_kvcodec.py tests/kernels/test_attention.py
    tests/engine/test_runner.py tests/engine/test_runner_prefill.py tests/engine/test_engine_runner.py"
if [ "$1" = 1 ]; then
    timeout 150 python3 -u .ci/gpu/sweep_tile_k.py --hi --json "$OUT/sweep_tile_k_hi.json" 2>&1 | grep -v Warn | grep "M= 1"
    timeout 300 bash .ci/gpu/bench27b.sh --rows 1 4 16 2>&1 | grep -v Warn | tail -14
elif [ "$1" = 2 ]; then
    timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider $TESTS \
        -k "not smollm2 and not gemma3_real and not cuda_engine_matches_cpu_path" > "$OUT/gpu_tests.txt" 2>&1
    m27_wait
    timeout 330 python3 -u -m app.cli bench agents -m /tmp/m27.gguf --device cuda --servers hivejet \
        --json "$OUT/agents_hivejet.json" 2>&1 | grep -v Warn | tail -12
    grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests.txt" | tail -12
elif [ "$1" = 3 ]; then
    timeout 300 bash .ci/gpu/bench27b.sh --rows 1 4 16 2>&1 | grep -v Warn | tail -14
else
    m27_wait
    timeout 120 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --device cuda --depths 0 --rows 1 16 -n 32 \
        --profile --json "$OUT/profile_27b.json" 2>&1 | grep -v Warn | tail -30
    tar xJf .bench-srv/llama-server-*.tar.xz -C /tmp
    timeout 400 python3 -u -m app.cli bench agents -m /tmp/m27.gguf --llamacpp /tmp --servers llama.cpp \
        --json "$OUT/agents_llamacpp.json" 2>&1 | grep -v Warn | tail -12
fi
