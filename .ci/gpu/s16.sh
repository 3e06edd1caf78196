#!/bin/bash
# For the next GPU session (written in the fifteenth, not run yet), carrying .whl (see README.md: gguf,
# platformdirs, the serve wheels, opentelemetry-api):
#   run 1 (and .bench-bin): the GPU tests of the packed matmul, codecs, attention, runner, prompt chunks
#          and engine, then `bench decode` with llama-bench: the first end-to-end figures after Q6_K's
#          2-bit plane went to fragment order (its matmuls measured alone: a step's 9.34 -> 8.60 ms);
#   run 2: `bench agents` with HiveJet;
#   run 3 (and .bench-srv): `bench agents` with llama-server, in the same lease as run 2.
source .ci/gpu/env.sh
m27_start
TESTS="tests/kernels/test_packed.py tests/kernels/test_kvcodec.py tests/kernels/test_attention.py
    tests/engine/test_runner.py tests/engine/test_runner_prefill.py tests/engine/test_engine_runner.py"
if [ "$1" = 1 ]; then
    timeout 280 python3 -m pytest -q -m gpu -p no:cacheprovider $TESTS \
        -k "not smollm2 and not gemma3_real and not cuda_engine_matches_cpu_path" > "$OUT/gpu_tests.txt" 2>&1
    grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests.txt" | tail -12
    m27_wait
    timeout 290 bash .ci/gpu/bench27b.sh --rows 1 4 16 2>&1 | grep -v Warn | tail -14
elif [ "$1" = 2 ]; then
    m27_wait
    timeout 340 python3 -u -m app.cli bench agents -m /tmp/m27.gguf --device cuda --servers hivejet \
        --json "$OUT/agents_hivejet.json" 2>&1 | grep -v Warn | tail -12
else
    m27_wait
    tar xJf .bench-srv/llama-server-*.tar.xz -C /tmp
    timeout 500 python3 -u -m app.cli bench agents -m /tmp/m27.gguf --llamacpp /tmp --servers llama.cpp \
        --json "$OUT/agents_llamacpp.json" 2>&1 | grep -v Warn | tail -12
fi
