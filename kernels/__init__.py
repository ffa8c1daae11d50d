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
