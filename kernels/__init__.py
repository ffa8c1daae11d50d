"""Triton kernels. Without a GPU they run in Triton's interpreter, which must be chosen before
any kernel module is imported, so importing this package sets TRITON_INTERPRET=1 on a CPU machine."""
import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
