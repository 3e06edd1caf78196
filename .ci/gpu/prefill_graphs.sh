#!/bin/bash
# On the GPU machine: the piecewise prompt-chunk graphs (engine/runner_prefill.py): their GPU tests, the
# runner / engine GPU tests around them, then a 512-token chunk's wall and kernel time (prefill_profile.py).
source .ci/gpu/env.sh
m27_start
python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_runner_prefill.py tests/engine/test_runner.py \
    tests/engine/test_engine_runner.py -k "not smollm2 and not gemma3_real and not cuda_engine_matches_cpu_path" 2>&1 | tail -25
m27_wait
python3 -u .ci/gpu/prefill_profile.py /tmp/m27.gguf 2>&1 | grep -v Warn | head -40
