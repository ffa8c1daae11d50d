"""Every Triton kernel compiles for an NVIDIA GPU (sm_90, down to a cubin through ptxas), on any machine.

Triton's interpreter runs the kernels on a CPU but proves nothing about a GPU compile; `triton.compile`
with an explicit target does, and needs no GPU. It must run where Triton is not in interpreter mode, so
each case runs this module (python -m tests.test_gpu_compile) in a subprocess with TRITON_INTERPRET=0.
"""
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

FLASH = dict(pointers=dict.fromkeys(("Q", "K", "V", "O", "dO", "dQ", "dK", "dV"), "*{dtype}") |
             dict.fromkeys(("L", "Delta"), "*fp32") | {"counters": "*i64"})
CASES = {  # kernel: (module, pointer types, constexprs); {dtype} is filled per case
    "flash_fwd": ("kernels.flash_attention", "_fwd_kernel", FLASH["pointers"],
                  dict(CAUSAL=True, BLOCK_M=128, BLOCK_N=64, HEAD_DIM=64, ELEM=2, PRECISION="tf32", COUNT_TRAFFIC=True)),
    "flash_delta": ("kernels.flash_attention", "_bwd_delta_kernel", FLASH["pointers"],
                    dict(BLOCK_M=128, HEAD_DIM=64, ELEM=2, COUNT_TRAFFIC=True)),
    "flash_dkdv": ("kernels.flash_attention", "_bwd_dkdv_kernel", FLASH["pointers"],
                   dict(CAUSAL=True, BLOCK_M=64, BLOCK_N=64, HEAD_DIM=64, ELEM=2, PRECISION="tf32", COUNT_TRAFFIC=False)),
    "flash_dq": ("kernels.flash_attention", "_bwd_dq_kernel", FLASH["pointers"],
                 dict(CAUSAL=False, BLOCK_M=64, BLOCK_N=64, HEAD_DIM=64, ELEM=2, PRECISION="tf32", COUNT_TRAFFIC=True)),
    "matmul": ("kernels.matmul", "_matmul_kernel",
               {"A": "*{dtype}", "B": "*{dtype}", "C": "*{dtype}", "counters": "*i64", "Order": "*i32"},
               dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=32, GROUP_M=8, ELEM=2, ELEM_C=2, PRECISION="tf32", COUNT_TRAFFIC=True,
                    RECORD_ORDER=True)),
    "nsa_selected": ("kernels.nsa_selected", "_selected_kernel",
                     {"Q": "*fp32", "K": "*fp32", "V": "*fp32", "O": "*fp32", "Blocks": "*i32", "Real": "*i32", "counters": "*i64"},
                     dict(GROUP=4, GROUP_PAD=16, TOP_N=4, SEL_BLOCK=32, HEAD_DIM=64, ELEM=4, COUNT_TRAFFIC=True)),
}


def compile_case(case: str, dtype: str, arch: int) -> dict:
    """Compile one kernel for cuda sm_<arch>; returns the sizes of what it produced (run with TRITON_INTERPRET=0)."""
    import importlib

    module, name, pointers, constexprs = CASES[case]
    kernel = getattr(importlib.import_module(module), name)  # first: `kernels` must be imported before triton

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {arg: "constexpr" if arg in constexprs else pointers[arg].format(dtype=dtype) if arg in pointers
                 else "fp32" if arg == "scale" else "i32" for arg in kernel.arg_names}
    source = ASTSource(fn=kernel, signature=signature,
                       constexprs={(kernel.arg_names.index(k),): v for k, v in constexprs.items()})
    compiled = triton.compile(source, target=GPUTarget("cuda", arch, 32), options={"num_warps": 4, "num_stages": 3})
    return {stage: len(text) for stage, text in compiled.asm.items()}


@pytest.mark.parametrize("case, dtype", [(c, "fp16") for c in CASES] + [("matmul", "bf16")])
def test_kernel_compiles_for_sm90(case, dtype):
    done = subprocess.run([sys.executable, "-m", "tests.test_gpu_compile", case, dtype, "90"], cwd=REPO,
                          env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "cubin" in done.stdout, done.stdout


if __name__ == "__main__":
    print(compile_case(sys.argv[1], sys.argv[2], int(sys.argv[3])))
