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
# (beside the tests), `m27_wait` waits for it; nothing when it is already there.
M27_PID=
m27_start() {
    [ -f /tmp/m27.gguf ] && return
    python3 -c "from engine.synth import write_synthetic; write_synthetic('/tmp/m27.gguf', 'qwen35', '27b-q4_k_m', threads=16)" \
        > /tmp/gen.log 2>&1 &
    M27_PID=$!
}
m27_wait() {
    if [ -n "$M27_PID" ]; then wait "$M27_PID"; M27_PID=; fi
    [ -f /tmp/m27.gguf ] || { m27_start; wait "$M27_PID"; M27_PID=; }
}
