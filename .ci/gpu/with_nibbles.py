"""On the GPU machine: run a module with kernels/quant/packed.py's NIBBLE_CONFIG from a JSON pick
(sweep_nibbles.py's $OUT/nibble_pick.json), so one call measures it end to end before it is committed.
    python3 -u .ci/gpu/with_nibbles.py PICK.json -m app.cli bench decode ..."""
import json
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
import kernels.quant.packed as packed  # noqa: E402

pick, rest = sys.argv[1], sys.argv[2:]
packed.NIBBLE_CONFIG = json.load(open(pick)) if os.path.exists(pick) else None
print("NIBBLE_CONFIG", packed.NIBBLE_CONFIG, file=sys.stderr, flush=True)
sys.argv = [rest[1]] + rest[2:]
runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
