#!/bin/bash
# Carry the two real test models to the GPU machine over several back-to-back calls (one call's tree is
# limited to 64 MiB): on this machine
#   tar cf models.tar -C ~/.local/share/hivejet/models SmolLM2-135M-Instruct.Q4_1.gguf gemma-3-270m-q4_k_m.gguf
#   split -b 62000000 -d models.tar part.    # then part.NN into .models/pNN/ (ignored by git)
# and per call, carrying .models/pNN:  bash .ci/gpu/carry_models.sh NN
# The last call also carries .whl and gives the tar's sha256: bash .ci/gpu/carry_models.sh NN SHA256
# (joins the parts into $HIVEJET_MODELS, then runs the GPU tests that need the real models).
set -e
cp .models/p$1/part.$1 /tmp/
[ -z "$2" ] && { ls -la /tmp/part.*; exit 0; }
source .ci/gpu/env.sh
cat /tmp/part.* > /tmp/models.tar
echo "$2  /tmp/models.tar" | sha256sum -c
tar xf /tmp/models.tar -C "$HIVEJET_MODELS"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_runner.py -k "greedy_equals_cpu" 2>&1 | tail -15
