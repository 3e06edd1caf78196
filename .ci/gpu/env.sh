# Source this on the GPU machine (the `run` tool's working tree): installs the wheels its image lacks,
# carried in .whl/ (gguf, platformdirs, pytest and its dependencies), and points HIVEJET_MODELS at
# .models/dl. The real test models do not fit in one call's 64 MiB: they were carried in parts (split -b
# 50000000), the first part copied to /tmp by one call and joined with the second by the next call
# (cat /tmp/PART1 .models/b/PART2 > .models/dl/FILE), then checked with sha256sum.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    >/dev/null 2>&1
export PYTHONPATH=/tmp/site:$PWD
export HIVEJET_MODELS=$PWD/.models/dl
mkdir -p "$HIVEJET_MODELS"

# The synthetic 27B at /tmp/m27.gguf (14 s on 16 cores): `m27_start` begins writing it in the background
# (beside the tests), `m27_wait` waits for it; nothing when it is already there. It is written under
# another name and renamed when whole, and a writer already running (started by a script that sourced
# this before: bench.sh inside a call that started it) is waited for rather than joined, so nothing reads or
# writes half a file.
M27_PID=
m27_writing() { pgrep -f "m27.part.gguf" >/dev/null; }
m27_start() {
    [ -f /tmp/m27.gguf ] || m27_writing && return
    python3 -c "import os; from engine.tools.synth import write_synthetic as w
w('/tmp/m27.part.gguf', 'qwen35', '27b-q4_k_m', threads=16); os.replace('/tmp/m27.part.gguf', '/tmp/m27.gguf')" \
        > /tmp/gen.log 2>&1 &
    M27_PID=$!
}
m27_wait() {
    if [ -n "$M27_PID" ]; then wait "$M27_PID"; M27_PID=; fi
    while [ ! -f /tmp/m27.gguf ] && m27_writing; do sleep 1; done
    [ -f /tmp/m27.gguf ] || { m27_start; wait "$M27_PID"; M27_PID=; }
}

# The GPU tests most calls run (packed matmul, codecs, attention, runner, prompt chunks, engine on the
# runner; the real-model ones need the models carried), into $OUT/gpu_tests.txt: `gpu_tests SECONDS`.
gpu_tests() {
    timeout "$1" python3 -m pytest -q -m gpu -p no:cacheprovider tests/kernels/test_packed.py \
        tests/kernels/test_kvcodec.py tests/kernels/test_attention.py tests/engine/test_runner.py \
        tests/engine/test_runner_prefill.py tests/engine/test_engine_runner.py \
        -k "not smollm2 and not gemma3_real and not cuda_engine_matches_cpu_path" > "$OUT/gpu_tests.txt" 2>&1
    grep -E "passed|failed|^FAILED|^E " "$OUT/gpu_tests.txt" | tail -12
}

# `bench agents` with one server into $OUT/agents_SERVER.json: `agents hivejet|llama.cpp SECONDS [SCENARIO ...]`
# (llama.cpp: llama-server unpacked from the carried .bench-srv/ into /tmp first; no scenarios: all five).
agents() {
    m27_wait
    local extra=(--device cuda)
    if [ "$1" = llama.cpp ]; then
        tar xJf .bench-srv/llama-server-*.tar.xz -C /tmp && extra=(--llamacpp /tmp)
    fi
    [ $# -gt 2 ] && extra+=(--scenarios "${@:3}")
    timeout "$2" python3 -u -m app.cli bench agents -m /tmp/m27.gguf "${extra[@]}" --servers "$1" \
        --json "$OUT/agents_${1/./}.json" 2>&1 | grep -v Warn | tail -14
}

# The synthetic 27B's decode step at 1 / 4 / 16 rows into $OUT/decode27b_LABEL.json, with the given environment
# settings (an experiment's switch): `bench LABEL [VAR=VALUE ...]`.
bench() {
    local label=$1; shift
    echo "$label"
    m27_wait
    env "$@" timeout 75 python3 -u -m app.cli bench decode -m /tmp/m27.gguf --depths 0 --rows 1 4 16 \
        --json "$OUT/decode27b_$label.json" 2>&1 | grep -v Warn | tail -3
}

# GPU tests into $OUT/FILE, their summary printed: `tests_into FILE PYTEST-ARGS...` (TESTS_SECONDS, default 240).
tests_into() {
    local file=$1; shift
    timeout "${TESTS_SECONDS:-240}" python3 -m pytest -q -m gpu -p no:cacheprovider -rf "$@" > "$OUT/$file" 2>&1
    grep -E "passed|failed|^FAILED|^E " "$OUT/$file" | tail -12
}
