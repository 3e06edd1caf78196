"""On the GPU machine: run a module with one module-level setting replaced by a JSON file's content (a
sweep's pick), so one call measures it end to end before it is committed:
    python3 -u .ci/gpu/with_config.py kernels.gdn.recurrent.DELTA_CONFIG=/tmp/gdn_pick.json -m app.cli bench decode ...
    python3 -u .ci/gpu/with_config.py kernels.attention.paged.DECODE_CONFIG=/tmp/attn.json .ci/gpu/ctx200k.py depth
A missing file leaves the setting as it is."""
import importlib
import json
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
target, path = sys.argv[1].split("=", 1)
mod_name, attr = target.rsplit(".", 1)
if os.path.exists(path):
    mod = importlib.import_module(mod_name)
    setattr(mod, attr, json.load(open(path)))
    print(target, "=", getattr(mod, attr), file=sys.stderr, flush=True)
rest = sys.argv[2:]
if rest[0] == "-m":
    sys.argv = [rest[1]] + rest[2:]
    runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
else:   # a script
    sys.argv = rest
    runpy.run_path(rest[0], run_name="__main__")
