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
