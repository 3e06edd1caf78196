#!/bin/bash
# On the GPU machine: HiveJet's benchmarks on the synthetic Qwen3.5-27B Q4_K_M (generated there, 16.5 GB,
# ~15 s), llama.cpp beside them where it has the same measurement. Results in $OUT. Carry .whl, and
# .bench-bin (llama-bench b11434) for `decode`.
#   bash .ci/gpu/bench.sh decode [ARGS]       hivejet bench decode beside llama-bench: pp512 / tg128 at depths 0 and
#                                             23000, steps of 1..64 rows (ARGS go to bench decode, e.g. --rows 1 4 16)
#   bash .ci/gpu/bench.sh steps LABEL [VAR=VALUE ...]
#                                             1 / 4 / 16-row steps with the given environment: one side of an A/B
#                                             (run both sides, twice, alternating, in one call)
#   bash .ci/gpu/bench.sh kv-types            decode tok/s at depth 23K and 128K per KV cache type (ctx200k.py depth)
#   bash .ci/gpu/bench.sh ctx200k             200,000 tokens of turbo3_tcq under a 24 GiB cap (ctx200k.py ctx200k)
#   bash .ci/gpu/bench.sh card24 [ARGS]       the engine as on a 24 GiB card: three agents beside a 20K prompt,
#                                             the prompt regenerated and followed up (engine24.py)
#   bash .ci/gpu/bench.sh pieces              k short prompts one pass each against one pass for all (pieces_timing.py)
#   bash .ci/gpu/bench.sh repeat [VAR=VALUE ...]
#                                             a 32-token prompt prefilled again, in another slot, among others, as a
#                                             shared-pass piece, eagerly: the same bits? (prefill_repeat.py)
#   bash .ci/gpu/bench.sh spec                bench spec on the 27B with a random MTP block (drafts never accepted):
#                                             verify-step and drafter costs, then off / ngram / mtp end to end
#   bash .ci/gpu/bench.sh spec-accept [RATES]  bench spec --accept (default 0.92,0.80,0.65) on the 27B with a random
#                                             MTP block, 1 / 4 / 8 / 16 agents: off, controlled, uncontrolled
#   bash .ci/gpu/bench.sh vision              the Qwen3.5-27B vision tower (synthetic F16) on a 1024x768 image
set -e
source .ci/gpu/env.sh
OUT=$(realpath "${OUT:-/tmp}")
what=${1:-decode}
shift || true
case "$what" in
    decode)
        m27_start; m27_wait
        tar xJf .bench-bin/llama-bench-*.tar.xz -C /tmp
        timeout 540 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --llamacpp /tmp "$@" \
            --json "$OUT/bench_decode.json" 2>&1 | grep -v Warn | tail -30
        ;;
    steps)
        m27_start
        bench "$@"
        ;;
    kv-types)
        m27_start; m27_wait
        timeout 540 python3 -u .ci/gpu/ctx200k.py depth 2>&1 | grep -v Warn | tail -12
        ;;
    ctx200k)
        m27_start; m27_wait
        timeout 560 python3 -u .ci/gpu/ctx200k.py ctx200k --budget 300 2>&1 | grep -v Warn | tail -12
        ;;
    card24)
        m27_start; m27_wait
        timeout 400 python3 -u .ci/gpu/engine24.py --json "$OUT/engine24.json" "$@" 2>&1 | grep -v Warn | tail -6
        ;;
    pieces)
        m27_start; m27_wait
        timeout 300 python3 -u .ci/gpu/pieces_timing.py /tmp/m27.gguf 32 512 2>&1 | grep -v Warn | tail -20
        ;;
    repeat)
        m27_start; m27_wait
        env "$@" timeout 300 python3 -u .ci/gpu/prefill_repeat.py /tmp/m27.gguf 32 2>&1 | grep -v Warn | tail -20
        ;;
    spec)
        python3 -c "import os; from engine.tools.synth import write_synthetic as w
w('/tmp/m27mtp.part.gguf', 'qwen35', '27b-q4_k_m', mtp=True, threads=16); os.replace('/tmp/m27mtp.part.gguf', '/tmp/m27mtp.gguf')"
        timeout 250 python3 -u -m app.cli bench spec -m /tmp/m27mtp.gguf --device cuda --verify-rows \
            --json "$OUT/spec_verify.json" 2>&1 | grep -v Warn | tail -20
        timeout 250 python3 -u -m app.cli bench spec -m /tmp/m27mtp.gguf --device cuda -n 128 \
            --json "$OUT/spec_modes.json" 2>&1 | grep -v Warn | tail -10
        ;;
    spec-accept)
        [ -f /tmp/m27mtp.gguf ] || python3 -c "import os; from engine.tools.synth import write_synthetic as w
w('/tmp/m27mtp.part.gguf', 'qwen35', '27b-q4_k_m', mtp=True, threads=16); os.replace('/tmp/m27mtp.part.gguf', '/tmp/m27mtp.gguf')"
        timeout 540 python3 -u -m app.cli bench spec -m /tmp/m27mtp.gguf --device cuda --accept "${1:-0.92,0.80,0.65}" \
            --json "$OUT/spec_accept.json" 2>&1 | grep -v Warn | tail -10
        ;;
    vision)
        timeout 300 python3 -u -m engine.tools.bench_vision --device cuda --size 1024x768 2>&1 | grep -v Warn | tail -10
        ;;
    *)
        echo "usage: bash .ci/gpu/bench.sh decode|steps|kv-types|ctx200k|card24|pieces|repeat|spec|spec-accept|vision [ARGS]"; exit 2
        ;;
esac
