"""Whether a dead runner's CUDA graphs collected during a new capture invalidate it: the capture with
engine/runner.py's capture_guard, then without (python3 -u .ci/gpu/gc_check.py, twentieth session)."""
import contextlib
import engine.runner as er
import engine.runner_prefill as rp
from engine.models import open_model
from engine.synth import write_synthetic
from tests.engine.test_runner import dead_runner_then_capture
write_synthetic("/tmp/tl.gguf", "llama", "tiny", seed=3)
for guard in ("on", "off"):
    if guard == "off":
        er.capture_guard = rp.capture_guard = contextlib.nullcontext
    m = open_model("/tmp/tl.gguf")
    try:
        dead_runner_then_capture(m)
        print("guard", guard, "capture ok", flush=True)
    except Exception as e:
        print("guard", guard, "FAILED:", type(e).__name__, str(e)[:150], flush=True)
