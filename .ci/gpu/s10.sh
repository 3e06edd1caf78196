#!/bin/bash
# The tenth session's GPU calls, back to back (the machine stays warm between them), carrying .whl:
#   run 1: the synthetic 27B with an MTP block written in the background; the decode attention per cache
#          type (attn_codecs.py: turbo3_tcq's decoder now reads a 32-bit window per 8 values); the GPU tests
#          of the codecs, attention, prompt-chunk features and the GPU path's drafters (backed-off drafters
#          overlap their steps);
#   run 2: decode speed at 23K / 128K per cache type (ctx200k.py depth);
#   run 3: `bench spec` on the 27B with its random MTP block (never accepted): off / ngram / mtp.
source .ci/gpu/env.sh
M27MTP=/tmp/m27mtp.gguf
if [ "$1" = 1 ]; then
    [ -f $M27MTP ] || setsid nohup python3 -c "import os; from engine.synth import write_synthetic; \
write_synthetic('$M27MTP.tmp', 'qwen35', '27b-q4_k_m', mtp=True, threads=16); os.rename('$M27MTP.tmp', '$M27MTP')" \
        > /tmp/gen_mtp.log 2>&1 < /dev/null &
    python3 -u .ci/gpu/attn_codecs.py 2>&1 | grep -v Warn
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_kvcodec.py tests/kernels/test_attention.py \
        tests/engine/test_runner_prefill.py tests/engine/test_engine_runner.py \
        -k "not smollm2 and not gemma3 and not cuda_engine_matches_cpu_path" 2>&1 | tail -15
    exit 0
fi
for i in $(seq 90); do [ -f $M27MTP ] && break; sleep 2; done
if [ "$1" = 2 ]; then
    ln -sf $M27MTP /tmp/m27.gguf
    python3 -u .ci/gpu/ctx200k.py depth 2>&1 | grep -v Warn | tail -12
    exit 0
fi
python3 -m app.cli bench spec -m $M27MTP --device cuda -n 128 --json "$OUT/spec_27b_s10.json" 2>&1 | grep -v Warn | tail -16
