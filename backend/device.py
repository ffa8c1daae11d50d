"""What this machine computes on: CPU or GPU, and whether Triton kernels run natively or interpreted."""
from __future__ import annotations

import functools
import importlib.metadata
import os


@functools.cache
def describe() -> dict:
    import torch

    info = {"torch": torch.__version__, "cpu_cores": os.cpu_count()}
    try:  # the version without importing triton: importing it before `kernels` would fix interpreter mode off
        info["triton"] = importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        info["triton"] = None
    if torch.cuda.is_available():
        info.update(device="cuda", name=torch.cuda.get_device_name(0), gpus=torch.cuda.device_count())
    else:
        info.update(device="cpu", name=f"CPU ({os.cpu_count()} cores)", gpus=0)
    interpreted = os.environ.get("TRITON_INTERPRET") == "1" or info["device"] == "cpu"
    info["triton_mode"] = "interpreter" if interpreted else "native"
    return info
