#!/bin/bash
# The thirtieth session's calls (2026-12-05): s29.sh's measurements regrouped so that the first call alone
# decides whether the prompt pieces go on by default (device machines were scarce: each refused start cost
# ~90 s of the session's device time). Carry .whl.
#   run 1: the GPU tests of the pieces and the rows kernel with both switches on; pieces_timing.py with both
#          on; bench agents scenario 1 with both on.
#   run 2: run 1's pieces_timing said "same bits False" even for one prompt (prefill_pieces then calls
#          prefill itself): prefill_repeat.py asks whether a prompt's prefill gives the same bits every time
#          (graphs; the padded pass eagerly, each layer's output recorded to show where a difference starts;
#          unpadded), by default, with both switches, and with PDL off; then bench agents scenario 1 by default
#          (the same-session baseline).
#   run 3: run 2 found it with PDL on (the default) and not with HIVEJET_PDL=0, from the first FFN on: which part
#          of PDL's use (the small kernels letting the next launch before they wait, the weights' L2 prefetch
#          before the wait, the matmul trigger's place, split-K sums in the kernel, the gated sums) brings it;
#          the records now include each rms_norm, gated sum and matmul. Then bench decode with PDL off and on.
#          (First the thirty-first session's GPU tests: images on the GPU path, pdl_enter's orders.)
#   run 4: the rest of run 3 (a call may take 600 s).
source .ci/gpu/env.sh
OUT=$(realpath "$OUT")
m27_start
ON="HIVEJET_PROMPT_PIECES=1 HIVEJET_GDN_ROWS_KERNEL=1"
timing() {   # timing LABEL [VAR=VALUE ...]
    local label=$1; shift
    echo "$label"; mkdir -p "$OUT/$label"
    env "$@" OUT="$OUT/$label" timeout 100 python3 -u .ci/gpu/pieces_timing.py /tmp/m27.gguf 32 512 \
        2>&1 | grep -v Warn | tail -7
}
repeat() {   # repeat SECONDS LABEL:VAR=VALUE ...: prefill_repeat.py once per setting, its JSON one result a line
    local seconds=$1; shift
    for run in "$@"; do
        echo "${run%%:*}"; mkdir -p "$OUT/repeat_${run%%:*}"
        env ${run#*:} OUT="$OUT/repeat_${run%%:*}" timeout "$seconds" python3 -u .ci/gpu/prefill_repeat.py \
            /tmp/m27.gguf 32 2>&1 | grep -v Warn | tr -d " \n" | sed "s/},/},\n/g"; echo
    done
}
if [ "$1" = 1 ]; then
    (export $ON TESTS_SECONDS=140; tests_into gpu_tests_1.txt tests/kernels/test_gdn_rows.py \
        tests/engine/test_runner_pieces.py tests/engine/test_runner_prefill.py tests/engine/test_runner.py \
        -k "rows_kernel or pieces or captured or (greedy_equals_cpu and qwen35) or (every_cache_type and qwen35)")
    m27_wait
    timing both $ON
    (export $ON; agents hivejet 200 1)      # (shell functions: the switches exported in a subshell)
    mv "$OUT/agents_hivejet.json" "$OUT/agents_hivejet_pieces.json"
fi
if [ "$1" = 2 ]; then
    m27_wait
    repeat 140 "off:HIVEJET_PDL=1" "both:HIVEJET_PDL=1 $ON" "nopdl:HIVEJET_PDL=0"   # (as run then: PDL on)
    agents hivejet 200 1
fi
if [ "$1" = 3 ]; then
    # (while the model is written: the thirty-first session's GPU tests, images on the GPU path and
    # pdl_enter's two orders)
    TESTS_SECONDS=100 tests_into gpu_tests_3.txt tests/engine/test_vision_runner.py tests/kernels/test_pdl.py
    # the Qwen3.5-27B vision tower (synthetic, F16) on a 1024x768 image (docs/VISION.md: not measured yet)
    timeout 60 python3 -u -m engine.vision.bench --device cuda --size 1024x768 2>&1 | tail -3 | tee "$OUT/vision_bench.txt"
    m27_wait
    # (PDL is off by default since run 2: each setting turns it on; wait_first: pdl_enter waits before it
    # lets the next kernel launch, so at most one kernel runs ahead)
    # (matmul_only / small_only: PDL for the packed decode matmul's launches only / for every other kernel only)
    repeat 100 "pdl:HIVEJET_PDL=1" "wait_first:HIVEJET_PDL=1 HIVEJET_PDL_ENTER=wait" \
        "matmul_only:HIVEJET_PDL=1 HIVEJET_PDL_KERNELS=matmul" "small_only:HIVEJET_PDL=1 HIVEJET_PDL_KERNELS=small" \
        | grep -E "^[a-z_0-9]+$|again|first_diff"
    bench nopdl                    # (the default now: what reproducible prefills cost the decode step)
    bench wait_first HIVEJET_PDL=1 HIVEJET_PDL_ENTER=wait
fi
if [ "$1" = 4 ]; then
    # (run 3 split in two for the 600 s a call may take: the other PDL settings, then PDL as it was)
    m27_wait
    repeat 100 "prefetch0:HIVEJET_PDL=1 HIVEJET_PREFETCH_TILES=0" \
        "trigger_start:HIVEJET_PDL=1 HIVEJET_PDL_TRIGGER=start" "sumhere0:HIVEJET_PDL=1 HIVEJET_SPLIT_SUM_HERE=0" \
        "gated0:HIVEJET_PDL=1 HIVEJET_GATED_SUMS=0" | grep -E "^[a-z_0-9]+$|again|first_diff"
    bench pdl HIVEJET_PDL=1
fi
