#!/bin/bash
# For the next GPU session (written in the fifteenth, not run yet), carrying .whl (see README.md: gguf,
# platformdirs, the serve wheels, opentelemetry-api):
#   run 1 (and .bench-bin): `s15.sh 2` again (the GPU tests, then `bench decode` with llama-bench): the
#          first end-to-end figures after Q6_K's 2-bit plane went to fragment order (its matmuls measured
#          alone: a step's 9.34 -> 8.60 ms);
#   run 2: `bench agents` with HiveJet;
#   run 3 (and .bench-srv): `bench agents` with llama-server, in the same lease as run 2.
if [ "$1" = 1 ]; then
    exec bash .ci/gpu/s15.sh 2
fi
source .ci/gpu/env.sh
m27_start
if [ "$1" = 2 ]; then
    agents hivejet 340
else
    agents llama.cpp 500
fi
