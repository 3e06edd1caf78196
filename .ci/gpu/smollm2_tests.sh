#!/bin/bash
# After `carry_models.sh 00` (one call), carrying .models/p01 and .whl: SmolLM2 is whole in parts 00+01 (the
# tar's first member); the GPU tests that compare the CUDA engine and the device sampler with the CPU.
cp .models/p01s/part.01 /tmp/   # (its first 36.5 MB: the rest of SmolLM2)
source .ci/gpu/env.sh
cat /tmp/part.00 /tmp/part.01 | tar x -C "$HIVEJET_MODELS" SmolLM2-135M-Instruct.Q4_1.gguf 2>/dev/null
sha256sum "$HIVEJET_MODELS/SmolLM2-135M-Instruct.Q4_1.gguf"
python3 -m pytest -q -m gpu -p no:cacheprovider tests/engine/test_engine_runner.py tests/engine/test_sample_device.py \
    -k "cuda_engine_matches_cpu_path or device_choice_matches" 2>&1 | tail -5
