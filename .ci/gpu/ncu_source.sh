#!/bin/bash
# Nsight Compute's per-instruction view of one decode matrix (.ci/gpu/ncu_matmul.py ARGS): every SASS line
# with its warp-stall samples and shared-memory wavefronts (SourceCounters), as CSV in $OUT/source_NAME.csv.
#   bash .ci/gpu/ncu_source.sh NAME TYPE N K [...]
source .ci/gpu/ncu_lib.sh
name=$1
shift
ncu_matmul "$OUT/source_$name.csv" "${NCU_SECONDS:-90}" \
    --section SourceCounters --section WarpStateStats --page source --print-source sass --csv -- "$@" || exit 1
echo "source_$name.csv: $(wc -l < "$OUT/source_$name.csv") lines"; head -c 600 "$OUT/source_$name.csv"; echo
