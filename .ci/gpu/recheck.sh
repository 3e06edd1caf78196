#!/bin/bash
# On the GPU machine, the eighth session's unmeasured ends: the chunked delta rule at real sizes and the
# prompt-chunk graphs' tests, then the 200K turbo3_tcq run (peak reserved memory now that the runner
# empties the allocator's cache after capturing a prompt chunk; it was 3.75 % over the plan's total).
source .ci/gpu/env.sh
m27_start
python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_gdn_chunk.py tests/engine/test_runner_prefill.py 2>&1 | tail -3
m27_wait
python3 -u .ci/gpu/ctx200k.py ctx200k --budget 270 2>&1 | grep -v Warn | grep -A4 '"memory"\|plan_error\|prefill_tok_s'
