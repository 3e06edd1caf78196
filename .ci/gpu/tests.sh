#!/bin/bash
# On the GPU machine: every test marked gpu (kernels against their torch references at real sizes,
# the runner against the CPU), plus anything given in "$@".
source .ci/gpu/env.sh
python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels tests/engine/test_runner.py "$@"
