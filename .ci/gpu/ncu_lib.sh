# Sourced by ncu.sh, ncu_stalls.sh and ncu_source.sh: `ncu_matmul OUT_FILE SECONDS NCU_OPTIONS... -- ARGS`
# runs Nsight Compute (the clocks as they are) on one launch of the decode matmul after warm-up, the matrix
# given by .ci/gpu/ncu_matmul.py ARGS, its report into OUT_FILE.
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
