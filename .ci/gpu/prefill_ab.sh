#!/bin/bash
# On the GPU machine: the delta rule's chunk-scan kernel (kernels/gdn/chunk.py, off by default) tested,
# then a prompt chunk's wall / kernel time (prefill_profile.py) without and with it -> $OUT.
source .ci/gpu/env.sh
GEN=
if [ ! -f /tmp/m27.gguf ]; then
    python3 -c "from engine.synth import write_synthetic; write_synthetic('/tmp/m27.gguf', 'qwen35', '27b-q4_k_m', threads=16)" > /tmp/gen.log 2>&1 &
    GEN=$!
fi
python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_gdn_chunk.py tests/engine/test_runner.py \
    -k "chunk or qwen35" 2>&1 | tail -4
[ -z "$GEN" ] || wait $GEN
echo false > /tmp/off.json; echo true > /tmp/on.json
for v in off on; do
    echo "== chunk-scan kernel $v"
    OUT_SAVE=$OUT; export OUT=$OUT_SAVE/$v; mkdir -p "$OUT"
    python3 -u .ci/gpu/with_config.py kernels.gdn.chunk.USE_KERNEL=/tmp/$v.json .ci/gpu/prefill_profile.py /tmp/m27.gguf \
        2>&1 | grep -v Warn | grep "^depth"
    export OUT=$OUT_SAVE
done
