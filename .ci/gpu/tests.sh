#!/bin/bash
# On the GPU machine: the tests marked gpu, in parts that each fit one 10-minute call of the machine.
#   bash .ci/gpu/tests.sh list          the parts and their test files
#   bash .ci/gpu/tests.sh N [ARGS]      part N (ARGS go to pytest, e.g. -k EXPR or -x), output in $OUT/tests_N.txt
#   bash .ci/gpu/tests.sh all [ARGS]    every part in one run (longer than one call: for a machine of your own)
# The tests that need the real SmolLM2 / Gemma-3 models are deselected unless REAL_MODELS=1 (carry them first:
# carry_models.sh). TESTS_SECONDS (default 560) bounds each part.
PARTS=(
    ""  # (parts count from 1)
    "tests/kernels/test_packed.py tests/kernels/test_q4_gemm.py tests/kernels/test_quant_ref.py tests/kernels/test_pdl.py"
    "tests/kernels/test_attention.py tests/kernels/test_flash.py tests/kernels/test_kvcodec.py tests/kernels/test_kv_write.py tests/kernels/test_fused.py tests/kernels/test_gdn.py tests/kernels/test_gdn_chunk.py tests/kernels/test_gdn_rows.py tests/kernels/test_gdn_verify.py"
    "tests/engine/test_runner.py"
    "tests/engine/test_runner_prefill.py tests/engine/test_runner_pieces.py tests/engine/test_runner_pool.py tests/engine/test_runner_prefix.py"
    "tests/engine/test_engine_runner.py tests/engine/test_sample_device.py tests/engine/test_sampling.py tests/engine/test_spec_mtp.py tests/engine/test_vision_runner.py"
)
NAMES=("" "matmul kernels" "attention, KV codecs, fused and DeltaNet kernels" "the runner" \
    "prompt chunks, pieces, pool, prefix sharing" "the engine on the runner, device sampling, drafts, images")

# A part's files that exist now (the tree moves; a file named here and gone is reported, not passed to pytest).
files_of() {
    local f
    for f in ${PARTS[$1]}; do
        if [ -f "$f" ]; then echo "$f"; else echo "tests.sh: $f is gone: update PARTS" >&2; fi
    done
}

# Every test file with gpu tests that no part names, so that a new one is not silently left out.
unlisted() {
    local listed=" ${PARTS[*]} " f
    for f in $(grep -rlE "mark\.gpu|pytest\.mark\.gpu" tests --include='test_*.py' | sort); do
        [[ "$listed" == *" $f "* ]] || echo "$f"
    done
}

run_part() {
    local n=$1; shift
    local deselect=(-k "not smollm2 and not gemma3_real and not cuda_engine_matches_cpu_path and not equals_cpu[gemma3]")
    [ -n "$REAL_MODELS" ] && deselect=()
    echo "part $n: ${NAMES[$n]}"
    timeout "${TESTS_SECONDS:-560}" python3 -m pytest -q -m gpu -p no:cacheprovider -rf $(files_of "$n") \
        "${deselect[@]}" "$@" > "${OUT:-/tmp}/tests_$n.txt" 2>&1
    grep -E "passed|failed|error|^FAILED|^ERROR|^E " "${OUT:-/tmp}/tests_$n.txt" | tail -15
}

case "$1" in
    list)
        for n in $(seq 1 $((${#PARTS[@]} - 1))); do echo "$n: ${NAMES[$n]}: ${PARTS[$n]}"; done
        rest=$(unlisted); [ -n "$rest" ] && echo "not in any part (add them): $rest"
        ;;
    all)
        shift
        source .ci/gpu/env.sh
        for n in $(seq 1 $((${#PARTS[@]} - 1))); do run_part "$n" "$@"; done
        ;;
    [1-9])
        n=$1; shift
        [ "$n" -lt "${#PARTS[@]}" ] || { echo "no part $n (bash .ci/gpu/tests.sh list)"; exit 2; }
        source .ci/gpu/env.sh
        run_part "$n" "$@"
        ;;
    *)
        echo "usage: bash .ci/gpu/tests.sh list | N [PYTEST-ARGS] | all [PYTEST-ARGS]"; exit 2
        ;;
esac
