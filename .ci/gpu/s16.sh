#!/bin/bash
# The sixteenth session's GPU calls (runs 1-4 ran, in that order; 5 did not: no device time left),
# carrying .whl (see README.md: gguf, platformdirs, the serve wheels, opentelemetry-api):
#   run 1 (and .bench-bin): `s15.sh 2` again (the GPU tests, then `bench decode` with llama-bench): the
#          first end-to-end figures after Q6_K's 2-bit plane went to fragment order (its matmuls measured
#          alone: a step's 9.34 -> 8.60 ms);
#   run 2: one replay of the 1- and 16-row decode graphs under torch.profiler (step_timeline.py: busy
#          time per kernel and the gaps between kernels), then `bench agents` with HiveJet;
#   run 3 (and .bench-bin): programmatic dependent launch (kernels/pdl.py): the GPU tests of the packed
#          matmul and the runner with it, sweep_pdl.py (the step's matmuls with PDL off / on, prefetching
#          0-all tiles), `bench decode` at depth 0 with HIVEJET_PDL=0, then bench27b.sh with llama-bench;
#   run 4: `bench decode` at depth 0 with PDL off, on with the matmul's trigger at its start, and after
#          its tiles (each prefetching 1 tile), then `bench agents` with HiveJet;
#   run 5 (and .bench-srv): `bench agents` with llama-server.
if [ "$1" = 1 ]; then
    exec bash .ci/gpu/s15.sh 2
fi
source .ci/gpu/env.sh
m27_start
if [ "$1" = 2 ]; then
    m27_wait
    timeout 100 python3 -u .ci/gpu/step_timeline.py /tmp/m27.gguf --json "$OUT/step_timeline.json" 2>&1 | grep -v Warn | tail -32
    agents hivejet 340
elif [ "$1" = 3 ]; then
    timeout 200 python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_packed.py tests/engine/test_runner.py \
        -k "not smollm2 and not gemma3" > "$OUT/gpu_tests_pdl.txt" 2>&1
    grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests_pdl.txt" | tail -8
    m27_wait
    timeout 150 python3 -u .ci/gpu/sweep_pdl.py /tmp/m27.gguf --json "$OUT/sweep_pdl.json" 2>&1 | grep -v Warn | tail -18
    HIVEJET_PDL=0 timeout 100 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --depths 0 --rows 1 16 \
        --json "$OUT/decode27b_nopdl.json" 2>&1 | grep -v Warn | tail -6
    timeout 200 bash .ci/gpu/bench27b.sh --rows 1 4 16 2>&1 | grep -v Warn | tail -14
elif [ "$1" = 4 ]; then
    m27_wait
    for v in "HIVEJET_PDL=0" "HIVEJET_PDL_TRIGGER=start" "HIVEJET_PDL_TRIGGER=end" "HIVEJET_PDL=0"; do
        echo "$v"
        env "$v" timeout 100 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --depths 0 --rows 1 16 \
            --json "$OUT/decode27b_$(echo "${v#HIVEJET_}" | tr = _).json" 2>&1 | grep -v Warn | tail -5
    done
    agents hivejet 300
else
    agents llama.cpp 500
fi
