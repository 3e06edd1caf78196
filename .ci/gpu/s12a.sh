#!/bin/bash
# The twelfth session's first GPU call (carrying .whl and .bench-bin): the attention and cache-codec GPU
# tests, one layer of decode attention per cache type with the float rows' vectorized loads and with the
# previous per-value loads (HEAD~ of kernels/kvcodec/triton_decode.py), a short f16 settings sweep, then
# `bench decode` with llama-bench.
source .ci/gpu/env.sh
m27_start
timeout 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_attention.py tests/kernels/test_kvcodec.py \
    2>&1 | tail -3
ATTN_TYPES=f16,q8_0,turbo4 timeout 60 python3 -u .ci/gpu/attn_codecs.py 2>&1 | grep -v Warn
cp "$OUT/attn_codecs.json" "$OUT/attn_codecs_new.json"
cp kernels/kvcodec/triton_decode.py /tmp/new_decode.py
git show "${OLD_REV:-HEAD}:kernels/kvcodec/triton_decode.py" > kernels/kvcodec/triton_decode.py
ATTN_TYPES=f16 timeout 40 python3 -u .ci/gpu/attn_codecs.py 2>&1 | grep -v Warn
cp "$OUT/attn_codecs.json" "$OUT/attn_codecs_old.json"
cp /tmp/new_decode.py kernels/kvcodec/triton_decode.py
SWEEP_TYPES=f16 timeout 100 python3 -u .ci/gpu/sweep_attn.py 70 2>&1 | grep -v Warn | tail -5
timeout 330 bash .ci/gpu/bench27b.sh --rows 1 4 16 2>&1 | grep -v Warn | tail -16
