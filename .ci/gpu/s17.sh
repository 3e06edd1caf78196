#!/bin/bash
# The seventeenth session's GPU calls, carrying .whl (see README.md; runs 1 and 2 ran at commit bc45edf, whose
# tests/kernels/test_gated_input.py the next commit took out with the fused input):
#   run 1: the GPU tests of the fused matmul input (tests/kernels/test_gated_input.py), the packed matmul
#          and the runner; `bench decode` at depth 0 with HIVEJET_FUSED_INPUT=0 / 1 / 0 (the SwiGLU, the
#          attention's sigmoid gate and the DeltaNet's gated norm in their own kernels, or made by the
#          matmul as it loads x); the step's timeline; sweep_tile_k.py --warps (the fused runs failed:
#          matmul_tuned asked the GatedInput for its device);
#   run 2: the same with that mended, sweep_tile_k.py --stages instead of --warps;
#   run 3 (and .bench-bin; the fused input taken out, 4 stages for the 4-bit-only projections to 5120 rows):
#          the GPU tests, `bench decode` at depth 0 with HIVEJET_DEEP_PIPELINE_MAX_N=0 / default / 0, then
#          bench27b.sh with llama-bench (its GPU tests ran out of their 170 s at 75 %, one failure);
#   run 4: the GPU tests alone, with time to finish.
source .ci/gpu/env.sh
if [ "$1" = 4 ]; then
    gpu_tests 330
    exit
fi
if [ "$1" = 3 ]; then
    m27_start
    gpu_tests 170
    m27_wait
    for v in 0 5120 0; do
        echo "HIVEJET_DEEP_PIPELINE_MAX_N=$v"
        HIVEJET_DEEP_PIPELINE_MAX_N=$v timeout 70 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --depths 0 \
            --rows 1 16 --json "$OUT/decode27b_deep$v.json" 2>&1 | grep -v Warn | tail -4
    done
    timeout 210 bash .ci/gpu/bench27b.sh --rows 1 4 16 2>&1 | grep -v Warn | tail -14
    exit
fi
m27_start
timeout 170 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_gated_input.py \
    tests/kernels/test_packed.py tests/engine/test_runner.py -k "not smollm2 and not gemma3" \
    > "$OUT/gpu_tests_s17.txt" 2>&1
grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests_s17.txt" | tail -8
m27_wait
for v in 0 1 0 1; do
    echo "HIVEJET_FUSED_INPUT=$v"
    HIVEJET_FUSED_INPUT=$v timeout 90 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --depths 0 --rows 1 16 \
        --json "$OUT/decode27b_fused$v.json" 2>&1 | grep -v Warn | tail -4
done
timeout 60 python3 -u .ci/gpu/step_timeline.py /tmp/m27.gguf --json "$OUT/step_timeline.json" 2>&1 | grep -v Warn | tail -20
if [ "$1" = 1 ]; then
    timeout 120 python3 -u .ci/gpu/sweep_tile_k.py --warps --json "$OUT/sweep_warps.json" 2>&1 | grep -v Warn | tail -80
else
    timeout 150 python3 -u .ci/gpu/sweep_tile_k.py --stages --json "$OUT/sweep_stages.json" 2>&1 | grep -v Warn | tail -60
fi
