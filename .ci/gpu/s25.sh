#!/bin/bash
# Twenty-fifth session (2026-12-04; carry .whl). Both experiments were measured and not kept, so every run
# needs the commit it ran at checked out first (docs/PERFORMANCE.md, twenty-fifth session):
#   run 1 (at 6ea2da0): split-K counts that need not divide a matrix's K tiles: the packed matmul's split tests
#          on the GPU, sweep_split.py --any over the 27B's decode matrices (each matrix's fastest count ->
#          $OUT/splits.json), then bench decode with the engine's splits and with those (HIVEJET_DECODE_SPLITS)
#   run 2 SPLITS.json (at 39acd64, with .ci/gpu/splits_s25.json; and at 0231db1, the count a compile-time
#          constant again): bench decode default / SPLITS / default / SPLITS (one call)
#   run 3 SPLITS.json (at 90a305d): the split tests on the GPU, then bench decode with the 64-row tiles' registers
#          capped at 64 / 72 (HIVEJET_DECODE_MAXNREG) and without, on the engine's splits and on SPLITS
#   run 4 SPLITS.json (at fc30ad7): the FFN chain's GPU tests and ffn_chain_bench.py; then bench decode with the
#          twenty-fourth session's packed.py (.ci/gpu/alt_packed_s24.py, untracked: `git show
#          77a1460:kernels/quant/packed.py`, in a copy of the tree) against this tree on SPLITS, alternating
#   run 5 (at 4ff2ac6): the FFN chain's GPU tests with inputs that keep h finite, ffn_chain_bench.py over
#          register caps and the two ways of polling
#   run 6 (at d706279): the same with a program per item (--programs 0) against the looping programs
#   run 7 (the engine as committed): bench decode default / scale codes kept (HIVEJET_PACKED_CODES=1: 256-value
#          tiles by TMA) / codes in 128-value tiles (and HIVEJET_PACKED_TILE_K=128: the tile in registers) /
#          default: fewer bytes against more work per tile on the current kernel
#   run 8 (prepared, not run: this session's device time was spent): read_ceiling.py --gluon: how fast one launch
#          can merely read each decode matrix's bytes (plain Triton, and warp-specialized Gluon with TMA) beside the
#          packed matmul's time, so how much of the matmuls' time a better one-launch kernel could win
source .ci/gpu/env.sh
OUT=$(realpath "$OUT")
[ "$1" = 5 ] || [ "$1" = 6 ] || m27_start      # (the runs that use the 27B; it is written beside their tests)
if [ "$1" = 1 ]; then
    tests_into gpu_tests_split.txt tests/kernels/test_packed.py -k "split"
    m27_wait
    timeout 300 python3 -u .ci/gpu/sweep_split.py /tmp/m27.gguf --any --json "$OUT/sweep_split_any.json" \
        --best "$OUT/splits.json" 2>&1 | grep -v Warn | grep -E "engine split|step's|fastest" 
    cp "$OUT/splits.json" /tmp/splits.json
    bench default_1
    bench splits_2 HIVEJET_DECODE_SPLITS=/tmp/splits.json
fi
if [ "$1" = 2 ]; then
    m27_wait
    bench default_1
    bench splits_2 HIVEJET_DECODE_SPLITS="$2"
    bench default_3
    bench splits_4 HIVEJET_DECODE_SPLITS="$2"
fi
if [ "$1" = 3 ]; then
    tests_into gpu_tests_split.txt tests/kernels/test_packed.py -k "split"
    m27_wait
    bench default_1
    bench cap64_2 HIVEJET_DECODE_MAXNREG=128:128,64:64
    bench splits_3 HIVEJET_DECODE_SPLITS="$2"
    bench splits_cap64_4 HIVEJET_DECODE_SPLITS="$2" HIVEJET_DECODE_MAXNREG=128:128,64:64
    bench splits_cap72_5 HIVEJET_DECODE_SPLITS="$2" HIVEJET_DECODE_MAXNREG=128:128,64:72
    bench cap64_6 HIVEJET_DECODE_MAXNREG=128:128,64:64
    bench splits_cap64_7 HIVEJET_DECODE_SPLITS="$2" HIVEJET_DECODE_MAXNREG=128:128,64:64
fi
if [ "$1" = 4 ]; then
    tests_into gpu_tests_chain.txt tests/kernels/test_ffn_chain.py
    timeout 240 python3 -u .ci/gpu/ffn_chain_bench.py --json "$OUT/ffn_chain.json" 2>&1 | grep -v Warn
    m27_wait
    rm -rf /tmp/alt && cp -r . /tmp/alt && cp .ci/gpu/alt_packed_s24.py /tmp/alt/kernels/quant/packed.py
    for n in 1 3; do
        (cd /tmp/alt && bench s24_$n PYTHONPATH=/tmp/site:/tmp/alt)
        bench splits_$((n + 1)) HIVEJET_DECODE_SPLITS="$2"
    done
fi
if [ "$1" = 5 ]; then
    tests_into gpu_tests_chain.txt tests/kernels/test_ffn_chain.py
    timeout 300 python3 -u .ci/gpu/ffn_chain_bench.py --splits 4:17 --programs 4 --caps 128 0 168 --polls 0 1 \
        --json "$OUT/ffn_chain.json" 2>&1 | grep -v Warn
fi
if [ "$1" = 6 ]; then
    tests_into gpu_tests_chain.txt tests/kernels/test_ffn_chain.py
    timeout 300 python3 -u .ci/gpu/ffn_chain_bench.py --splits 4:17 4:34 --programs 0 4 --caps 128 --polls 0 1 \
        --json "$OUT/ffn_chain_one.json" 2>&1 | grep -v Warn
fi
if [ "$1" = 7 ]; then
    m27_wait
    bench default_1
    bench codes_2 HIVEJET_PACKED_CODES=1
    bench codes128_3 HIVEJET_PACKED_CODES=1 HIVEJET_PACKED_TILE_K=128
    bench default_4
fi
if [ "$1" = 8 ]; then
    m27_wait
    timeout 400 python3 -u .ci/gpu/read_ceiling.py /tmp/m27.gguf --gluon --json "$OUT/read_ceiling.json" 2>&1 \
        | grep -v Warn
fi
