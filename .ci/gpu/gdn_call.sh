#!/bin/bash
# On the GPU machine (this session's fourth call): GPU tests of the DeltaNet gates / stacked weights, the
# DeltaNet kernel sweep, then bench decode with the sweep's pick (and the profile).
source .ci/gpu/env.sh
m27_start
python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_gdn.py tests/engine/test_runner.py -x \
    -k "not smollm2 and not gemma3_real and not test_gpu_greedy_equals_cpu[gemma3]" 2>&1 | tail -6
python3 -u .ci/gpu/sweep_gdn.py 2>&1 | tail -8
m27_wait
python3 -u .ci/gpu/with_config.py kernels.gdn.recurrent.DELTA_CONFIG=/tmp/gdn_pick.json -m app.cli bench decode \
    -m /tmp/m27.gguf --depths 0 23000 --rows 1 4 16 --profile --json "$OUT/decode_gdn.json" 2>&1 | grep -v "^\s*$" | tail -45
