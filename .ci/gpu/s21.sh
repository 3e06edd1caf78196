#!/bin/bash
# For the next session with device time, carrying .whl (gguf, platformdirs, pytest's; fastapi 0.115.14 and
# starlette 0.46.2, not 0.165 / 1.x: fastapi 0.165 imports opentelemetry, which the image lacks) and, for
# run 3, .bench-srv (llama-server):
#   run 1: the full agents benchmark with --prefill-chunk 512 (whether scenario 4's two targets hold together
#          in a clean run: the 20K prompt's first token <= 9.1 s and >= 50 % decode beside it; scenario 2's
#          23K reads faster too), then the GPU tests with the time left
#   run 2: the same with the default 256 in the same session (the figures beside it)
#   run 3: llama-server's agents (scenarios 1-3, then 4-5 in a second call if one does not hold all five)
# Added in the twenty-first session (run 1 gave 9.13 s for the 20K prompt at 512, 51.5 % decode beside it):
#   run 4: the engine as on a 24 GiB card (.ci/gpu/engine24.py: three agents and a 20K prompt) with prompt
#          chunks of 512 (the new default) and 256, then scenario 4 on the new default
#   run 5: llama-server's scenario 4 in the same session (SCEN=4 s21.sh 3), then HiveJet's again
#   run 6: with prefill_chunk's automatic default (1024 with 16 GiB free after the weights, else 512): the full
#          agents benchmark, the engine as on a 24 GiB card with the default and with 1024 (the planner's
#          larger workspace for chunks over 512 rows), then the GPU tests
source .ci/gpu/env.sh
m27_start
if [ "$1" = 1 ]; then
    m27_wait
    timeout 420 python3 -u -m app.cli bench agents -m /tmp/m27.gguf --device cuda --servers hivejet \
        --serve-args "--prefill-chunk 512" --json "$OUT/agents_chunk512.json" 2>&1 | grep -v Warn | tail -12
    gpu_tests 120
fi
if [ "$1" = 2 ]; then
    agents hivejet 430
fi
if [ "$1" = 3 ]; then
    m27_wait
    tar xJf .bench-srv/llama-server-*.tar.xz -C /tmp
    timeout 560 python3 -u -m app.cli bench agents -m /tmp/m27.gguf --llamacpp /tmp --servers llama.cpp \
        --scenarios ${SCEN:-1 2 3} --json "$OUT/agents_llamacpp.json" 2>&1 | grep -v Warn | tail -12
fi
if [ "$1" = 4 ]; then
    m27_wait
    for pc in 512 256; do
        timeout 170 python3 -u .ci/gpu/engine24.py --prefill-chunk $pc --json "$OUT/engine24_$pc.json" 2>&1 \
            | grep -v Warn | tail -3
    done
    timeout 200 python3 -u -m app.cli bench agents -m /tmp/m27.gguf --device cuda --servers hivejet \
        --scenarios 4 --json "$OUT/agents_s4_hivejet.json" 2>&1 | grep -v Warn | tail -4
fi
if [ "$1" = 6 ]; then
    agents hivejet 300
    for pc in 0 1024; do
        timeout 120 python3 -u .ci/gpu/engine24.py --prefill-chunk $pc --json "$OUT/engine24_auto_$pc.json" 2>&1 \
            | grep -v Warn | tail -2
    done
    gpu_tests 200
fi
