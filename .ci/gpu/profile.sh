#!/bin/bash
# On the GPU machine: where the synthetic Qwen3.5-27B's time goes. Results in $OUT. Carry .whl.
#   bash .ci/gpu/profile.sh timeline [--rows 1 16] [--sequence N]
#                        one replay of the decode graphs under torch.profiler: the step's span, busy time per
#                        kernel, idle gaps (step_timeline.py; --sequence N: the first N kernels in order)
#   bash .ci/gpu/profile.sh nsys [ROWS]
#                        Nsight Systems over bench decode's steps of ROWS rows (default 1): the kernels' timeline
#   bash .ci/gpu/profile.sh matmuls [ARGS]   every decode matrix alone at 1 and 16 rows (matmul_shapes.py)
#   bash .ci/gpu/profile.sh read-ceiling     how fast one launch can merely read each decode matrix (read_ceiling.py)
#   bash .ci/gpu/profile.sh launch-cost      each decode matrix alone and two copies in one launch (launch_cost.py)
#   bash .ci/gpu/profile.sh prefill [N CHUNK]  a prompt chunk's wall time against its kernels (prefill_profile.py)
#   bash .ci/gpu/profile.sh ncu NAME TYPE N K [--maxnreg R] [--x32]
#                        Nsight Compute on one decode matrix (ncu_matmul.py): speed of light, occupancy, scheduler
#                        and warp states, into $OUT/ncu_NAME.txt
#   bash .ci/gpu/profile.sh stalls NAME TYPE N K   stall reasons per issued instruction, bank conflicts, DRAM rate
#   bash .ci/gpu/profile.sh source NAME TYPE N K   every SASS instruction with its stall samples (CSV)
# e.g. the Q4_K gate+up stack of the 27B: bash .ci/gpu/profile.sh stalls gateup Q4_K 34816 5120
source .ci/gpu/env.sh
OUT=$(realpath "${OUT:-/tmp}")

# Nsight Compute (the clocks as they are) on one launch of the decode matmul after warm-up, the matrix given by
# ncu_matmul.py's arguments: `ncu_matmul OUT_FILE SECONDS NCU_OPTIONS... -- ARGS`.
ncu_matmul() {
    local out=$1 seconds=$2 opts=()
    shift 2
    while [ "$#" -gt 0 ] && [ "$1" != -- ]; do opts+=("$1"); shift; done
    shift
    local ncu
    ncu=$(command -v ncu || ls /usr/local/cuda*/bin/ncu /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    [ -n "$ncu" ] || { echo "no ncu on this machine"; return 1; }
    timeout "$seconds" "$ncu" --clock-control none -k regex:_packed_mm --launch-skip 4 --launch-count 1 \
        "${opts[@]}" python3 .ci/gpu/ncu_matmul.py "$@" > "$out" 2>&1
}

what=$1
shift || true
case "$what" in
    timeline)
        m27_start; m27_wait
        timeout 300 python3 -u .ci/gpu/step_timeline.py /tmp/m27.gguf "$@" --json "$OUT/step_timeline.json" \
            2>&1 | grep -v Warn | tail -30
        ;;
    nsys)
        m27_start; m27_wait
        nsys=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems/*/bin/nsys 2>/dev/null | head -1)
        [ -n "$nsys" ] || { echo "no nsys on this machine"; exit 1; }
        timeout 400 "$nsys" profile -t cuda,nvtx --cuda-graph-trace=node -o "$OUT/decode_steps" --force-overwrite true \
            python3 -u -m app.cli bench decode -m /tmp/m27.gguf --depths 0 --rows "${1:-1}" 2>&1 | tail -5
        "$nsys" stats -r cuda_gpu_kern_sum "$OUT/decode_steps.nsys-rep" 2>/dev/null | head -40 > "$OUT/decode_steps_kernels.txt"
        head -30 "$OUT/decode_steps_kernels.txt"
        ;;
    matmuls)
        m27_start; m27_wait
        timeout 400 python3 -u .ci/gpu/matmul_shapes.py /tmp/m27.gguf "$@" 2>&1 | grep -v Warn | tail -20
        ;;
    read-ceiling)
        m27_start; m27_wait
        timeout 500 python3 -u .ci/gpu/read_ceiling.py /tmp/m27.gguf --gluon 2>&1 | grep -v Warn | tail -20
        ;;
    launch-cost)
        m27_start; m27_wait
        timeout 400 python3 -u .ci/gpu/launch_cost.py /tmp/m27.gguf 2>&1 | grep -v Warn | tail -20
        ;;
    prefill)
        m27_start; m27_wait
        timeout 300 python3 -u .ci/gpu/prefill_profile.py /tmp/m27.gguf "$@" 2>&1 | grep -v Warn | tail -30
        ;;
    ncu)
        name=$1; shift
        ncu_matmul "$OUT/ncu_$name.txt" "${NCU_SECONDS:-75}" \
            --section SpeedOfLight --section Occupancy --section LaunchStats --section SchedulerStats \
            --section WarpStateStats --section MemoryWorkloadAnalysis --section SourceCounters -- "$@" || exit 1
        grep -E "Duration|DRAM Throughput|Memory Throughput|Registers Per|Achieved Occupancy|Theoretical Occupancy|Block Limit|Eligible Warps|Issued Warp|No Eligible|Warp Cycles Per Issued|Stall|stall" \
            "$OUT/ncu_$name.txt" | head -40
        ;;
    stalls)
        name=$1; shift
        ncu_matmul "$OUT/stalls_$name.txt" "${NCU_SECONDS:-75}" \
            --metrics "regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio,smsp__inst_executed.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum,l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum,l1tex__data_pipe_lsu_wavefronts_mem_shared.sum,dram__bytes_read.sum.per_second,gpu__time_duration.sum,sm__warps_active.avg.pct_of_peak_sustained_active" \
            -- "$@" || exit 1
        awk '/stalled/ && $NF+0 > 0.05 {print} /bank_conflicts|wavefronts|dram__bytes|duration|inst_executed|warps_active/ {print}' \
            "$OUT/stalls_$name.txt"
        ;;
    source)
        name=$1; shift
        ncu_matmul "$OUT/source_$name.csv" "${NCU_SECONDS:-90}" \
            --section SourceCounters --section WarpStateStats --page source --print-source sass --csv -- "$@" || exit 1
        echo "source_$name.csv: $(wc -l < "$OUT/source_$name.csv") lines"; head -c 600 "$OUT/source_$name.csv"; echo
        ;;
    *)
        echo "usage: bash .ci/gpu/profile.sh timeline|nsys|matmuls|read-ceiling|launch-cost|prefill|ncu|stalls|source [ARGS]"
        exit 2
        ;;
esac
