"""How many kernels TorchInductor generates for the same function, counted from the code it wrote.

torch.compile runs the function (and its backward, given the same incoming gradient); Inductor's output code
is captured with run_and_get_code and its kernel definitions are counted; the compiled function's output and gradients come back for checking. On a GPU these are Triton kernels;
on a CPU Inductor writes C++ loops instead (`cpp_fused_*`), which fuse differently: a C++ loop nest can
produce a row reduction and a column reduction in one pass, which a Triton kernel cannot.
"""
from __future__ import annotations

import re

import torch
from torch._inductor.utils import run_and_get_code

PATTERNS = {"triton": r"^(triton_\w+) = async_compile\.triton\(", "cpp": r"^(cpp_fused_\w+) = async_compile\.cpp"}
EXTERN = r"extern_kernels\.(\w+)\("


def kernel_counts(fn, inputs: list[torch.Tensor], tangent: torch.Tensor | None, device: str = "cpu") -> dict:
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True)
    args = [t.detach().to(device).requires_grad_(tangent is not None) for t in inputs]

    def step():
        out = compiled(*args)
        if tangent is not None:
            out.backward(tangent.to(device))
        return out

    out, codes = run_and_get_code(step)
    values = [out.detach().cpu()] + ([a.grad.detach().cpu() for a in args] if tangent is not None else [])
    backend = "triton" if device == "cuda" else "cpp"
    per_graph = []
    for code in codes:
        kernels = sorted(set(re.findall(PATTERNS[backend], code, flags=re.M)))
        externs = re.findall(EXTERN, code)
        per_graph.append({"kernels": len(kernels), "names": kernels, "extern_calls": len(externs)})
    forward = per_graph[0] if per_graph else {"kernels": 0, "names": [], "extern_calls": 0}
    backward = per_graph[1] if len(per_graph) > 1 else {"kernels": 0, "names": [], "extern_calls": 0}
    return {"backend": f"TorchInductor {backend} ({torch.__version__})", "forward_kernels": forward["kernels"],
            "backward_kernels": backward["kernels"], "extern_calls": forward["extern_calls"] + backward["extern_calls"],
            "kernel_names": forward["names"] + backward["names"], "values": values}
