"""On the GPU machine: run a module with kernels/quant/packed.py's TMA_CONFIG from a JSON pick
(sweep_tma.py's $OUT/tma_pick.json), so one call measures it end to end before it is committed.
    python3 -u .ci/gpu/with_tma.py PICK.json -m app.cli bench decode ..."""
import json
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
import kernels.quant.packed as packed  # noqa: E402

pick, rest = sys.argv[1], sys.argv[2:]
packed.TMA_CONFIG = json.load(open(pick)) if os.path.exists(pick) else None
print("TMA_CONFIG", packed.TMA_CONFIG, file=sys.stderr, flush=True)
sys.argv = [rest[1]] + rest[2:]
runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
