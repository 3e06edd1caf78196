"""Triton's interpreter (TRITON_INTERPRET=1, the CPU test path) with numpy >= 2.4: scalars are
1-element arrays there and `int()` of those now raises ("only 0-dimensional arrays can be converted
to Python scalars"), which breaks `range(...)` with runtime bounds inside kernels
(triton-lang/triton#9171). Apply the fix proposed in that issue (squeeze before int) until the
installed Triton has it. No effect on compiled GPU kernels."""
from __future__ import annotations

import os


def apply() -> None:
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return
    try:
        from triton.runtime import interpreter
    except ImportError:
        return
    orig = interpreter._patch_lang_tensor
    if getattr(orig, "_hivejet_fixed", False):
        return

    def patched(tensor, scope):
        orig(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.squeeze()))

    patched._hivejet_fixed = True
    interpreter._patch_lang_tensor = patched
