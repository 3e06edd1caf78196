#!/bin/bash
# Nsight Compute's per-instruction view of one decode matrix (.ci/gpu/ncu_matmul.py ARGS): every SASS line
# with its warp-stall samples and shared-memory wavefronts (SourceCounters), as CSV in $OUT/source_NAME.csv.
#   bash .ci/gpu/ncu_source.sh NAME TYPE N K [...]
name=$1
shift
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
timeout "${NCU_SECONDS:-90}" "$NCU" --clock-control none -k regex:_packed_mm --launch-skip 4 --launch-count 1 \
    --section SourceCounters --section WarpStateStats --page source --print-source sass --csv \
    python3 .ci/gpu/ncu_matmul.py "$@" > "$OUT/source_$name.csv" 2>&1
echo "source_$name.csv: $(wc -l < "$OUT/source_$name.csv") lines"; head -c 600 "$OUT/source_$name.csv"; echo
