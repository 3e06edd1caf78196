#!/bin/bash
# On the GPU machine: the delta rule's chunk-scan kernel (kernels/gdn/chunk.py, off by default) tested,
# then a prompt chunk's wall / kernel time (prefill_profile.py) without and with it -> $OUT.
source .ci/gpu/env.sh
m27_start
python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_gdn_chunk.py tests/engine/test_runner.py \
    -k "chunk or qwen35" 2>&1 | tail -4
m27_wait
echo false > /tmp/off.json; echo true > /tmp/on.json
for v in off on; do
    echo "== chunk-scan kernel $v"
    OUT_SAVE=$OUT; export OUT=$OUT_SAVE/$v; mkdir -p "$OUT"
    python3 -u .ci/gpu/with_config.py kernels.gdn.chunk.USE_KERNEL=/tmp/$v.json .ci/gpu/prefill_profile.py /tmp/m27.gguf \
        2>&1 | grep -v Warn | grep "^depth"
    export OUT=$OUT_SAVE
done
