#!/bin/bash
# Issue #7 on the GPU machine, in two calls back to back (the machine stays warm between them):
#   run 1, carry .whl and .models/a: keeps the first half of SmolLM2 in /tmp, starts writing the synthetic
#          27B with an MTP block in the background, runs the MTP GPU tests;
#   run 2, carry .whl and .models/b: joins SmolLM2 (sha256 checked), `bench spec` on it (off / ngram, the
#          code-edit workload), then on the 27B: verify costs, the MTP block's cost, off / ngram / mtp runs.
source .ci/gpu/env.sh
M27MTP=/tmp/m27mtp.gguf
if [ "$1" = 1 ]; then
    cp .models/a/smol.part.aa /tmp/smol.part.aa
    setsid nohup python3 -c "import os; from engine.synth import write_synthetic; \
write_synthetic('$M27MTP.tmp', 'qwen35', '27b-q4_k_m', mtp=True, threads=16); os.rename('$M27MTP.tmp', '$M27MTP')" \
        > /tmp/gen_mtp.log 2>&1 < /dev/null &
    python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_spec_mtp.py tests/engine/test_spec_ngram.py 2>&1 | tail -3
    exit 0
fi
cat /tmp/smol.part.aa .models/b/smol.part.ab > "$HIVEJET_MODELS/SmolLM2-135M-Instruct.Q4_1.gguf"
sha256sum "$HIVEJET_MODELS/SmolLM2-135M-Instruct.Q4_1.gguf"
python3 -m app.cli bench spec -m "$HIVEJET_MODELS/SmolLM2-135M-Instruct.Q4_1.gguf" --device cuda -n 200 \
    --json "$OUT/spec_smollm2_h200.json" 2>&1 | grep -v Warn | tail -4
for i in $(seq 60); do [ -f $M27MTP ] && break; sleep 2; done
ls -la $M27MTP; tail -2 /tmp/gen_mtp.log
python3 -m app.cli bench spec -m $M27MTP --device cuda --verify-rows -n 128 \
    --json "$OUT/spec_27b_mtp_h200.json" 2>&1 | grep -v Warn | tail -24
