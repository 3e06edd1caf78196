#!/bin/bash
# On the GPU machine: the synthetic Qwen3.5-27B Q4_K_M (generated there, 16.5 GB), HiveJet's decode
# benchmark with llama.cpp's llama-bench (carried in .bench-bin/) in the same run. Results in $OUT.
set -e
source .ci/gpu/env.sh
m27_start; m27_wait
LLAMA=()
if [ -f .bench-bin/llama-bench-b11434-cuda-sm90.tar.xz ]; then
    tar xJf .bench-bin/llama-bench-b11434-cuda-sm90.tar.xz -C /tmp && LLAMA=(--llamacpp /tmp)
fi
python3 -u -m app.cli bench decode -m /tmp/m27.gguf "${LLAMA[@]}" "$@" --json "${OUT:-/tmp}/decode27b.json"
