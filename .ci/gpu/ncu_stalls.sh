#!/bin/bash
# Nsight Compute's stall reasons (per issued instruction) and shared-memory bank conflicts of one decode
# matrix (.ci/gpu/ncu_matmul.py ARGS) into $OUT/stalls_NAME.txt:   bash .ci/gpu/ncu_stalls.sh NAME TYPE N K [...]
source .ci/gpu/ncu_lib.sh
name=$1
shift
ncu_matmul "$OUT/stalls_$name.txt" "${NCU_SECONDS:-75}" \
    --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,dram__bytes_read.sum.per_second,gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active" \
    -- "$@" || exit 1
awk '/stalled/ && $NF+0 > 0.05 {print} /bank_conflicts|wavefronts|dram__bytes|duration|inst_executed|warps_active/ {print}' \
    "$OUT/stalls_$name.txt"
