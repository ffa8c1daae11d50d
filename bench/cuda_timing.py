"""Seconds per call of a GPU function: warm up, then the mean of `repeats` calls between synchronisations."""
import time

import torch


def timed(fn, warmup=3, repeats=10) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats
