#!/bin/bash
# Nsight Compute on one decode matrix (.ci/gpu/ncu_matmul.py ARGS): where its warps wait (warp states and
# the source lines they stall at), occupancy, and the DRAM throughput, one launch after warm-up, into
# $OUT/ncu_NAME.txt; the summary lines are printed.   bash .ci/gpu/ncu.sh NAME TYPE N K [--maxnreg R]
source .ci/gpu/ncu_lib.sh
name=$1
shift
ncu_matmul "$OUT/ncu_$name.txt" "${NCU_SECONDS:-75}" \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
    --section WarpStateStats --section MemoryWorkloadAnalysis --section SourceCounters -- "$@" || exit 1
grep -E "Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Eligible Warps|Issued Warp|No Eligible|Warp Cycles Per Issued|Stall|stall" \
    "$OUT/ncu_$name.txt" | head -40
