#!/bin/bash
# On the GPU machine: the GPU tests of the stacked weights / in-kernel split sums (and TMA, graphs),
# then `bench decode` at depth 0 alternating with and without them (.ci/gpu/without_stacks.py) while
# time allows. Results in $OUT/ab_*.json.
source .ci/gpu/env.sh
m27_start
python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/engine/test_runner.py -x \
    -k "${TESTS_K:-tma or graph_capture or split_sums or stacked or graphs_equal or gdn}" 2>&1 | tail -12
m27_wait
tail -2 /tmp/gen.log
i=0
for v in new old new old; do
    [ $SECONDS -lt ${AB_UNTIL:-450} ] || break
    i=$((i + 1))
    if [ $v = new ]; then run=(python3 -u -m app.cli); else run=(python3 -u .ci/gpu/without_stacks.py -m app.cli); fi
    extra=(); [ $i = 1 ] && extra=(--profile)
    "${run[@]}" bench decode -m /tmp/m27.gguf --depths 0 --rows 1 16 "${extra[@]}" --json "$OUT/ab_${i}_$v.json" 2>&1 \
        | grep -v "^\s*$" | tail -25
done
