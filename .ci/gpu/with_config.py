"""On the GPU machine: run a module or script with one module-level setting taken from a JSON file (a
sweep's pick), so one call measures it end to end before it is committed as the default. A dict setting
is updated with the file's keys, anything else replaced (`null` turns TMA_CONFIG off); a missing file
leaves the setting as it is.
    python3 -u .ci/gpu/with_config.py kernels.attention.paged.FLOAT_DECODE_CONFIG=/tmp/float_attn.json -m app.cli bench decode ...
    python3 -u .ci/gpu/with_config.py kernels.quant.packed.TMA_CONFIG=$OUT/tma_pick.json -m app.cli bench decode ...
    python3 -u .ci/gpu/with_config.py kernels.gdn.recurrent.DELTA_CONFIG=/tmp/gdn_pick.json .ci/gpu/ctx200k.py depth
(The earlier with_attn.py and with_tma.py in docs/PERFORMANCE.md's commands were this for those two.)"""
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
    old, new = getattr(mod, attr), json.load(open(path))
    setattr(mod, attr, {**old, **new} if isinstance(old, dict) and isinstance(new, dict) else new)
    print(target, "=", getattr(mod, attr), file=sys.stderr, flush=True)
rest = sys.argv[2:]
if rest[0] == "-m":
    sys.argv = [rest[1]] + rest[2:]
    runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
else:   # a script
    sys.argv = rest
    runpy.run_path(rest[0], run_name="__main__")
