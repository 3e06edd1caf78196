#!/bin/bash
# For the next session with device time, carrying .whl (gguf, platformdirs, pytest's; fastapi 0.115.14 and
# starlette 0.46.2, not 0.165 / 1.x: fastapi 0.165 imports opentelemetry, which the image lacks) and, for
# run 3, .bench-srv (llama-server):
#   run 1: the full agents benchmark with --prefill-chunk 512 (whether scenario 4's two targets hold together
#          in a clean run: the 20K prompt's first token <= 9.1 s and >= 50 % decode beside it; scenario 2's
#          23K reads faster too), then the GPU tests with the time left
#   run 2: the same with the default 256 in the same session (the figures beside it)
#   run 3: llama-server's agents (scenarios 1-3, then 4-5 in a second call if one does not hold all five)
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
