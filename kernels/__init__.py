"""Triton kernels. Without a GPU they run in Triton's interpreter, which must be chosen before
any kernel module is imported, so importing this package sets TRITON_INTERPRET=1 on a CPU machine."""
import os
import sys

import torch

if not torch.cuda.is_available():
    if "triton.language" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        # triton.language's own jit functions (tl.sum, ...) were already built for a GPU
        raise ImportError("triton was imported before `kernels` on a machine without a GPU: import kernels first "
                          "(or set TRITON_INTERPRET=1) so Triton's interpreter is chosen")
    os.environ.setdefault("TRITON_INTERPRET", "1")


def _patch_device_calls_once_per_launch() -> None:
    """Triton's interpreter re-patches triton.language on every call of a nested jit function (tl.sum, tl.max,
    tl.cdiv, ...), walking every member of the language modules each time (inspect.getmembers), and never restores
    those nested patches. Within one kernel launch the second and later re-patches change nothing, yet they were
    44 % of a paged-decode run's CPU time; here each distinct caller module is patched once per launch."""
    from triton.runtime import interpreter

    launch = interpreter.GridExecutor.__call__
    if getattr(launch, "_once_per_launch", False) or not hasattr(interpreter, "_patch_lang"):
        return
    patched: set[int] = set()

    def launch_once(self, *args, **kwargs):
        patched.clear()  # a new launch starts from the outer kernel's own patch, as before
        return launch(self, *args, **kwargs)

    def call_patched_once(self, *args, **kwargs):
        if id(self.fn.__globals__) not in patched:
            interpreter._patch_lang(self.fn)
            patched.add(id(self.fn.__globals__))
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise interpreter.InterpreterError(repr(e)) from e

    launch_once._once_per_launch = True
    interpreter.GridExecutor.__call__, interpreter.InterpretedFunction.__call__ = launch_once, call_patched_once


if os.environ.get("TRITON_INTERPRET") == "1":
    _patch_device_calls_once_per_launch()
