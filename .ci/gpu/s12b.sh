#!/bin/bash
# The twelfth session's GPU calls after the first (.ci/gpu/s12a.sh), back to back, carrying .whl (and
# .bench-bin for run 1):
#   run 1: the GPU tests of the codecs, attention, runner and prompt chunks; the decode attention's settings
#          inside CUDA graphs (sweep_attn.py); `bench decode` with llama-bench;
#   run 2: the GPU tests again (run 1's summary fell out of the output), then `bench agents` (HiveJet);
#   run 3: decode speed at 23K / 128K per cache type (ctx200k.py depth);
#   run 4: `bench agents` with llama-server (carrying .bench-srv).
source .ci/gpu/env.sh
m27_start
TESTS="tests/kernels/test_kvcodec.py tests/kernels/test_attention.py tests/engine/test_runner.py
    tests/engine/test_runner_prefill.py tests/engine/test_engine_runner.py"
if [ "$1" = 1 ]; then
    timeout 220 python3 -m pytest -q -m gpu -p no:cacheprovider $TESTS \
        -k "not smollm2 and not gemma3_real and not cuda_engine_matches_cpu_path" 2>&1 | grep -E "passed|failed|^FAILED|^E " | head -20
    timeout 90 python3 -u .ci/gpu/sweep_attn.py 75 2>&1 | grep -v Warn | grep -E "^top|cache" | head -20
    timeout 260 bash .ci/gpu/bench27b.sh --rows 1 4 16 2>&1 | grep -v Warn | tail -14
elif [ "$1" = 2 ]; then
    # (run 1's test summary fell out of the call's output tail: the tests again, their summary last)
    timeout 220 python3 -m pytest -q -m gpu -p no:cacheprovider $TESTS \
        -k "not smollm2 and not gemma3_real and not cuda_engine_matches_cpu_path" > "$OUT/gpu_tests.txt" 2>&1
    m27_wait
    timeout 330 python3 -u -m app.cli bench agents -m /tmp/m27.gguf --device cuda --servers hivejet \
        --json "$OUT/agents_hivejet.json" 2>&1 | grep -v Warn | tail -12
    grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests.txt" | tail -12
elif [ "$1" = 3 ]; then
    m27_wait
    timeout 200 python3 -u .ci/gpu/ctx200k.py depth 2>&1 | grep -v Warn | tail -8
else   # run 4 (carrying .bench-srv): llama-server through the same client
    m27_wait
    tar xJf .bench-srv/llama-server-*.tar.xz -C /tmp
    timeout 500 python3 -u -m app.cli bench agents -m /tmp/m27.gguf --llamacpp /tmp --servers llama.cpp \
        --json "$OUT/agents_llamacpp.json" 2>&1 | grep -v Warn | tail -12
fi
