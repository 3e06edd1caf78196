#!/bin/bash
# Twenty-sixth session (2026-12-04; carry .whl). Run 0 is s25.sh 8 (read_ceiling.py --gluon, the engine as
# committed). Runs 1-5 need the experiment's commit checked out (the code is history only; docs/PERFORMANCE.md,
# twenty-sixth session):
#   run 1 (at eda6385): matmul_shapes.py on the 27B's decode matrices with the packed matmul taken apart
#          (HIVEJET_ABLATE bits: 1 no split-K sums, 2 no dot (the dequantized tiles added elementwise), 4 no
#          dequantization (the tiles' bytes XORed)): where inside a program the time goes that
#          read_ceiling.py's readers do not spend
#   run 2 (at 226ed24): split-K's sums by the grid's last slice polling a sentinel in the partial sums
#          (HIVEJET_SPLIT_SUM=last) against counting arrivals (the default) and a second kernel: the split-sum
#          GPU tests, bench decode count / last / kernel / count / last, matmul_shapes.py for last
#   run 3 (at 16640b5): the same with the last slice's own partial stored and read back (fewer registers) and a
#          NaN sending it to wait slice by slice; bench decode also with 64-row tiles capped at 96 registers
#   run 4 (at 9f2e2f0): the same with a NaN sending it to read all the partials again first (HIVEJET_SUM_POLLS)
#   run 5 (at 49cca97): bench decode with the matmul taken apart end to end (wrong tokens; the step's timing
#          around them): HIVEJET_ABLATE 0 / 1 / 3 / 7, 0 again
#   run 6 (the engine as committed): the gate+up stack's partial sums added by the gated activation
#          (StackedWeights.gated): the GPU tests of the packed matmul, the fused kernels and the runner (tiny
#          llama / qwen35, stacked against separate), then bench decode with it / without it
#          (HIVEJET_GATED_SUMS=0), twice
source .ci/gpu/env.sh
OUT=$(realpath "$OUT")
m27_start
shapes() {   # shapes LABEL [VAR=VALUE ...]
    local label=$1; shift
    echo "== $label"
    env "$@" timeout 120 python3 -u .ci/gpu/matmul_shapes.py /tmp/m27.gguf --json "$OUT/shapes_$label.json" 2>&1 \
        | grep -v Warn | tail -14
}
if [ "$1" = 1 ]; then
    m27_wait
    for ab in 0 1 2 3 6 7; do shapes ablate$ab HIVEJET_ABLATE=$ab; done
fi
if [ "$1" = 2 ]; then
    tests_into gpu_tests_sums.txt tests/kernels/test_packed.py -k "split_sums"
    bench count_1
    bench last_2 HIVEJET_SPLIT_SUM=last
    bench kernel_3 HIVEJET_SPLIT_SUM=kernel
    bench count_4
    bench last_5 HIVEJET_SPLIT_SUM=last
    shapes last HIVEJET_SPLIT_SUM=last
fi
if [ "$1" = 3 ] || [ "$1" = 4 ]; then   # (run 4 also times the capped kernel alone)
    tests_into gpu_tests_sums.txt tests/kernels/test_packed.py -k "split_sums"
    bench count_1
    bench last_2 HIVEJET_SPLIT_SUM=last
    bench last_cap96_3 HIVEJET_SPLIT_SUM=last HIVEJET_DECODE_MAXNREG=128:128,64:96
    bench count_4
    bench last_5 HIVEJET_SPLIT_SUM=last
    shapes last HIVEJET_SPLIT_SUM=last
    [ "$1" = 4 ] && shapes last_cap96 HIVEJET_SPLIT_SUM=last HIVEJET_DECODE_MAXNREG=128:128,64:96
fi
if [ "$1" = 5 ]; then
    for ab in 0 1 3 7; do bench ablate${ab} HIVEJET_ABLATE=$ab; done
    bench ablate0_again
fi
if [ "$1" = 6 ]; then
    tests_into gpu_tests_gated.txt tests/kernels/test_packed.py tests/kernels/test_fused.py \
        tests/engine/test_runner.py -k "gated or split_sums or qwen35 or llama or stacked"
    bench gated_1
    bench plain_2 HIVEJET_GATED_SUMS=0
    bench gated_3
    bench plain_4 HIVEJET_GATED_SUMS=0
fi
