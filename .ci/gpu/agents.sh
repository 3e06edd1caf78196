#!/bin/bash
# On the GPU machine: `hivejet bench agents` (issue #6's five scenarios) on the synthetic Qwen3.5-27B Q4_K_M,
# with HiveJet's server or llama-server (b11434, carried in .bench-srv/) and the same client. Carry .whl (the
# server's wheels too: docs in .ci/gpu/README.md) and .bench-srv for llama.cpp. Results in $OUT/agents_SERVER.json,
# written after every scenario (a call cut short keeps the scenarios it finished).
#   bash .ci/gpu/agents.sh hivejet [SCENARIO ...]      all five scenarios by default: ~330 s
#   bash .ci/gpu/agents.sh llama.cpp 1                 llama-server is slower: scenario 1 in one call,
#   bash .ci/gpu/agents.sh llama.cpp 2 3 4 5           the rest in the next call on the same machine
# AGENTS_SECONDS (default 560) bounds the run.
set -e
source .ci/gpu/env.sh
OUT=$(realpath "${OUT:-/tmp}")
server=$1
shift || true
case "$server" in
    hivejet|llama.cpp) ;;
    *) echo "usage: bash .ci/gpu/agents.sh hivejet|llama.cpp [SCENARIO ...]"; exit 2 ;;
esac
m27_start
agents "$server" "${AGENTS_SECONDS:-560}" "$@"
