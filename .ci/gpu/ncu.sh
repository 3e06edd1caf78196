#!/bin/bash
# Nsight Compute on one decode matrix (.ci/gpu/ncu_matmul.py ARGS): where its warps wait (warp states and
# the source lines they stall at), occupancy, and the DRAM throughput, one launch after warm-up, into
# $OUT/ncu_NAME.txt; the summary lines are printed.   bash .ci/gpu/ncu.sh NAME TYPE N K [--maxnreg R]
name=$1
shift
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
[ -n "$NCU" ] || { echo "no ncu on this machine"; exit 1; }
timeout "${NCU_SECONDS:-75}" "$NCU" --clock-control none -k regex:_packed_mm --launch-skip 4 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section SourceCounters \
    python3 .ci/gpu/ncu_matmul.py "$@" > "$OUT/ncu_$name.txt" 2>&1
grep -E "Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Eligible Warps|Issued Warp|No Eligible|Warp Cycles Per Issued|Stall|stall" \
    "$OUT/ncu_$name.txt" | head -40
