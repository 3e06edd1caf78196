#!/bin/bash
# For the next session with device time, carrying .whl (see README.md):
#   run 1: 64-row tiles of 256 values (HIVEJET_PACKED_NARROW_TILE_K=256, the tile in registers; 140 registers,
#          so three programs per SM, or four under a cap of 128 that spills 136 bytes): the packed matmul's GPU
#          tests with it (the 5120-row shapes take it), `bench decode` default / 256 / 256 capped / default,
#          then matmul_shapes.py with it
#   run 2 (check out 3cfb33f first, and .bench-bin): the row-pair layout, `s19.sh 2`
#   run 3 (and .bench-bin): bench27b.sh on the default, llama-bench beside it
#   run 4: step_timeline.py with PDL (the default) and without (HIVEJET_PDL=0)
#   run 5: bench decode with HIVEJET_PREFETCH_TILES 1 / 2 / 4 / 8 / 1 / 2 (trigger at the start) / 4 / 2
#   run 6: bench decode with HIVEJET_PDL=0, then the default
# Ran in the twenty-fourth session (2026-12-04): runs 1, 3, 4 (as two calls), 5 and 6; run 2 was not (the
# twenty-third session's dequantization-free ceiling bounds what fewer PRMTs can give: 8 % of the matmuls).
source .ci/gpu/env.sh
m27_start
if [ "$1" = 1 ]; then
    HIVEJET_PACKED_NARROW_TILE_K=256 timeout 130 python3 -m pytest -q -m gpu -p no:cacheprovider -rf \
        tests/kernels/test_packed.py > "$OUT/gpu_tests_narrow.txt" 2>&1
    grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests_narrow.txt" | tail -8
    m27_wait
    for v in default 256 256:128 default; do
        n=$((n + 1))
        vars=()
        [ "$v" != default ] && vars=(HIVEJET_PACKED_NARROW_TILE_K=256)
        [ "$v" = 256:128 ] && vars+=(HIVEJET_DECODE_MAXNREG=128:128,64:128)
        echo "${vars[*]:-default}"
        env "${vars[@]}" timeout 75 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --depths 0 --rows 1 4 16 \
            --json "$OUT/decode27b_narrow_${v/:/_}_$n.json" 2>&1 | grep -v Warn | tail -4
    done
    HIVEJET_PACKED_NARROW_TILE_K=256 timeout 120 python3 -u .ci/gpu/matmul_shapes.py /tmp/m27.gguf \
        --json "$OUT/matmul_shapes_narrow.json" 2>&1 | grep -v Warn | tail -12
fi
if [ "$1" = 2 ]; then
    bash .ci/gpu/s19.sh 2
fi
if [ "$1" = 3 ]; then
    timeout 300 bash .ci/gpu/bench27b.sh --rows 1 4 8 16 2>&1 | grep -v Warn | tail -14
fi
if [ "$1" = 4 ]; then
    m27_wait
    timeout 150 python3 -u .ci/gpu/step_timeline.py /tmp/m27.gguf --json "$OUT/step_timeline.json" 2>&1 \
        | grep -v Warn | tail -34
    HIVEJET_PDL=0 timeout 150 python3 -u .ci/gpu/step_timeline.py /tmp/m27.gguf \
        --json "$OUT/step_timeline_nopdl.json" 2>&1 | grep -v Warn | tail -34
fi
if [ "$1" = 5 ]; then
    m27_wait
    n=0
    for v in 1 2 4 8 1 2:start 4 2; do
        n=$((n + 1))
        pf=${v%%:*}
        trigger=end
        [ "$v" != "$pf" ] && trigger=start
        echo "prefetch $pf, trigger at the $trigger"
        HIVEJET_PREFETCH_TILES=$pf HIVEJET_PDL_TRIGGER=$trigger timeout 70 python3 -u -m app.cli bench decode \
            -m /tmp/m27.gguf --depths 0 --rows 1 4 16 --json "$OUT/decode27b_prefetch${pf}_${trigger}_$n.json" \
            2>&1 | grep -v Warn | tail -3
    done
fi
if [ "$1" = 6 ]; then
    m27_wait
    for v in 0 1; do
        echo "HIVEJET_PDL=$v"
        HIVEJET_PDL=$v timeout 70 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --depths 0 --rows 1 4 16 \
            --json "$OUT/decode27b_pdl$v.json" 2>&1 | grep -v Warn | tail -3
    done
fi
