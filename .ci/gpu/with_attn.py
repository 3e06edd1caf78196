"""On the GPU machine: run a module or script with kernels/attention/paged.py's DECODE_CONFIG updated
from a JSON file (what sweep_attn.py picked, $OUT/attn_pick.json), so the benchmarks of the same
call measure the picked settings before they are committed as the defaults.
    python3 -u .ci/gpu/with_attn.py PICK.json -m app.cli bench decode ...
    python3 -u .ci/gpu/with_attn.py PICK.json .ci/gpu/ctx200k.py depth"""
import json
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
import kernels.attention.paged as paged  # noqa: E402

pick, rest = sys.argv[1], sys.argv[2:]
if os.path.exists(pick):
    paged.DECODE_CONFIG.update(json.load(open(pick)))
print("DECODE_CONFIG", paged.DECODE_CONFIG, file=sys.stderr, flush=True)
if rest[0] == "-m":
    sys.argv = [rest[1]] + rest[2:]
    runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
else:
    sys.argv = rest
    runpy.run_path(rest[0], run_name="__main__")
