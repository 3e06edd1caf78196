#!/bin/bash
# The eleventh session's second GPU call: the scale layouts against each other (sweep_scales.py), then
# `bench decode` rows 1 and 16 on the 27B packed each way (HIVEJET_PACKED_CODES=0 / 1), alternating, and
# the GPU runner test that failed in the first call, verbose.
source .ci/gpu/env.sh
m27_start
python3 -u .ci/gpu/sweep_scales.py --json "$OUT/sweep_scales_h200_s11.json" 2>&1 | grep -v Warn
m27_wait
for codes in 0 1 0 1; do
    HIVEJET_PACKED_CODES=$codes python3 -u -m app.cli bench decode -m /tmp/m27.gguf --depths 0 --rows 1 16 \
        --json "$OUT/decode_codes${codes}_$RANDOM.json" 2>&1 | grep -E "loaded|tg128|rows:"
done
timeout 120 python3 -m pytest -q -m gpu -p no:cacheprovider -x \
    "tests/engine/test_runner.py::test_gpu_runner_matches_cpu_runner_every_cache_type" 2>&1 | grep -E "Error|assert|passed|failed" | head -20
