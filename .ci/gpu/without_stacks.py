"""On the GPU machine: run a module as the engine was before stacked weights and in-kernel split-K sums
(every matrix multiplied on its own, split-K partials added by a second kernel), so one call measures
both end to end:
    python3 -u .ci/gpu/without_stacks.py -m app.cli bench decode ..."""
import os
import runpy
import sys

sys.path.insert(0, os.getcwd())
import engine.models.common as common  # noqa: E402
import kernels.quant.packed as packed  # noqa: E402

packed.SPLIT_SUM_HERE = False
common.DecoderModel.stack = lambda self, *parts: common.StackedWeights(*parts)   # never registered: never stacked
print("without stacked weights and in-kernel split sums", file=sys.stderr, flush=True)
rest = sys.argv[1:]
sys.argv = [rest[1]] + rest[2:]
runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
