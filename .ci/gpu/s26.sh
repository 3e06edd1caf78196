#!/bin/bash
# Twenty-sixth session (2026-12-04; carry .whl).
#   run 1 (at the commit with HIVEJET_ABLATE in kernels/quant/packed.py): matmul_shapes.py on the 27B's decode
#          matrices with the packed matmul taken apart (HIVEJET_ABLATE bits: 1 no split-K sums, 2 no dot (the
#          dequantized tiles added elementwise), 4 no dequantization (the tiles' bytes XORed)): where inside a
#          program the time goes that read_ceiling.py's readers do not spend
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
#   run 2 (at the commit with HIVEJET_SPLIT_SUM): the packed matmul's split-sum GPU tests, then bench decode with
#          split-K's sums made by counting arrivals (the default) / by the last slice polling a sentinel in the
#          partial sums / by a second kernel, alternating; matmul_shapes.py for the polled sums
bench() {   # bench LABEL [VAR=VALUE ...]
    local label=$1; shift
    echo "$label"
    env "$@" timeout 75 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --depths 0 --rows 1 4 16 \
        --json "$OUT/decode27b_$label.json" 2>&1 | grep -v Warn | tail -3
}
if [ "$1" = 2 ]; then
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/kernels/test_packed.py -k "split_sums" \
        > "$OUT/gpu_tests_sums.txt" 2>&1
    grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests_sums.txt" | tail -8
    m27_wait
    bench count_1
    bench last_2 HIVEJET_SPLIT_SUM=last
    bench kernel_3 HIVEJET_SPLIT_SUM=kernel
    bench count_4
    bench last_5 HIVEJET_SPLIT_SUM=last
    shapes last HIVEJET_SPLIT_SUM=last
fi
#   run 3 (at the commit after run 2's: the last slice stores and reads back its own partial too, a NaN in the
#          sum sends it to wait slice by slice): the split-sum GPU tests, bench decode count / last / last with
#          64-row tiles capped at 96 registers / count / last, matmul_shapes.py for last
if [ "$1" = 3 ]; then
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/kernels/test_packed.py -k "split_sums" \
        > "$OUT/gpu_tests_sums.txt" 2>&1
    grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests_sums.txt" | tail -8
    m27_wait
    bench count_1
    bench last_2 HIVEJET_SPLIT_SUM=last
    bench last_cap96_3 HIVEJET_SPLIT_SUM=last HIVEJET_DECODE_MAXNREG=128:128,64:96
    bench count_4
    bench last_5 HIVEJET_SPLIT_SUM=last
    shapes last HIVEJET_SPLIT_SUM=last
fi
#   run 4 (at the commit after run 3's: a NaN sends the last slice to read all partials again, up to
#          HIVEJET_SUM_POLLS times, before waiting slice by slice): as run 3
if [ "$1" = 4 ]; then
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider -rf tests/kernels/test_packed.py -k "split_sums" \
        > "$OUT/gpu_tests_sums.txt" 2>&1
    grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests_sums.txt" | tail -8
    m27_wait
    bench count_1
    bench last_2 HIVEJET_SPLIT_SUM=last
    bench last_cap96_3 HIVEJET_SPLIT_SUM=last HIVEJET_DECODE_MAXNREG=128:128,64:96
    bench count_4
    bench last_5 HIVEJET_SPLIT_SUM=last
    shapes last HIVEJET_SPLIT_SUM=last
    shapes last_cap96 HIVEJET_SPLIT_SUM=last HIVEJET_DECODE_MAXNREG=128:128,64:96
fi
#   run 5 (at the same commit as run 4): bench decode with the matmul taken apart end to end (wrong tokens, the
#          timing of the step around them): HIVEJET_ABLATE 0 / 1 (no split-K sums) / 3 (nor dot) / 7 (loads only)
if [ "$1" = 5 ]; then
    m27_wait
    for ab in 0 1 3 7; do bench ablate${ab} HIVEJET_ABLATE=$ab; done
    bench ablate0_again
fi
