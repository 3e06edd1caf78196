#!/bin/bash
# On the GPU machine: the engine forced to the sm86 family's kernel settings (HIVEJET_GPU_FAMILY=sm86, test-only,
# kernels/family.py: no TMA loads, no PDL, the consumer cards' rows of the kernels' tables) on the H100/H200.
#   bash .ci/gpu/families.sh           one call (~9 minutes): the GPU tests of tests/kernels and tests/engine -k runner
#                                      with the sm86 settings (FAMILY_TEST_SECONDS, default 330, bounds them; each
#                                      test's verdict is kept as it comes, in $OUT/families_sm86_tests.txt), then
#                                      `hivejet bench decode` on the synthetic 27B with the default (sm90) and the sm86
#                                      settings (decode27b_default.json, decode27b_sm86.json), their tok/s side by side
#   bash .ci/gpu/families.sh part N    tests.sh part N with the sm86 settings (the whole GPU suite, a part per call)
#   bash .ci/gpu/families.sh bench     only the two decode benchmarks
source .ci/gpu/env.sh

sm86_tests() {
    echo "GPU tests, sm86 settings"
    local k="(kernels or runner) and not smollm2 and not gemma3_real and not cuda_engine_matches_cpu_path"
    k="$k and not equals_cpu[gemma3]"
    [ -n "$REAL_MODELS" ] && k="kernels or runner"           # (the real models carried: carry_models.sh)
    HIVEJET_GPU_FAMILY=sm86 timeout "${FAMILY_TEST_SECONDS:-330}" python3 -m pytest -v -m gpu -p no:cacheprovider -rf \
        tests/kernels tests/engine -k "$k" > "$OUT/families_sm86_tests.txt" 2>&1
    echo "  passed $(grep -c ' PASSED' "$OUT/families_sm86_tests.txt"), failed $(grep -c ' FAILED' \
"$OUT/families_sm86_tests.txt"), skipped $(grep -c ' SKIPPED' "$OUT/families_sm86_tests.txt")"
    grep -E "^FAILED|^ERROR| FAILED|passed|failed" "$OUT/families_sm86_tests.txt" | tail -12
}

benches() {
    bench default
    bench sm86 HIVEJET_GPU_FAMILY=sm86
    python3 - <<'PY'
import json, os
out = os.environ.get("OUT", "/tmp")
for label in ("default", "sm86"):
    try:
        res = json.load(open(f"{out}/decode27b_{label}.json"))
    except (OSError, ValueError) as e:
        print(label, "no result:", e)
        continue
    steps = ", ".join(f"{r['rows']} rows {r['ms']:.2f} ms ({r['tok_s']:.1f} tok/s)" for r in res.get("rows", []))
    tg = ", ".join(f"{r['test']}@{r['depth']} {r['tok_s']:.1f} tok/s" for r in res.get("hivejet", []))
    print(f"{label}: family {res.get('family', '?')}; {tg}; {steps}; ceiling {res.get('ceiling_tok_s', 0):.1f} tok/s")
PY
}

case "$1" in
    part)
        HIVEJET_GPU_FAMILY=sm86 bash .ci/gpu/tests.sh "$2" "${@:3}"
        ;;
    bench)
        m27_start
        benches
        ;;
    *)
        m27_start                           # the synthetic 27B, written beside the tests
        sm86_tests
        benches
        ;;
esac
