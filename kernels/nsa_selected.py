"""NSA's selected-block branch in Triton: one program per (query position, KV group).

The group's query heads are loaded together as one tile (NSA's group-centric loading: every head of a
GQA group selected the same blocks, so they share each K/V block load). The program walks its TOP_N
block-table entries, loads each SEL_BLOCK x HEAD_DIM block of K and V (tokens after the query and
unused table entries masked out) and folds it in with the online softmax, so only the selected rows
are ever read. With COUNT_TRAFFIC it adds the bytes of K and V it loaded to two counters.

Reference beside it: `selected_reference`, torch SDPA over every key with the selection as a boolean
mask. Plain pointer arithmetic (no block pointers), so Triton's interpreter runs it on a CPU. The interpreter
proves no GPU compile: tests/test_gpu_compile.py compiles it to an sm_90 cubin without a GPU; running
it on a GPU is tested only where one is present.
"""
from __future__ import annotations

import kernels  # noqa: F401  (chooses the interpreter on a CPU before triton is used)

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

TENSORS = ("K", "V")


@triton.jit
def _selected_kernel(Q, K, V, Blocks, Real, O, counters, scale,
                     stride_qh, stride_qn, stride_kg, stride_kn, stride_bg, stride_bn, stride_oh, stride_on,
                     GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, TOP_N: tl.constexpr, SEL_BLOCK: tl.constexpr,
                     HEAD_DIM: tl.constexpr, ELEM: tl.constexpr, COUNT_TRAFFIC: tl.constexpr):
    t = tl.program_id(0)
    g = tl.program_id(1)
    heads = tl.arange(0, GROUP_PAD)
    dims = tl.arange(0, HEAD_DIM)
    head_ok = heads < GROUP
    q = tl.load(Q + (g * GROUP + heads)[:, None] * stride_qh + t * stride_qn + dims[None, :], mask=head_ok[:, None], other=0.0)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    table = g * stride_bg + t * stride_bn
    for i in range(TOP_N):
        tokens = tl.load(Blocks + table + i) * SEL_BLOCK + tl.arange(0, SEL_BLOCK)
        ok = (tokens <= t) & (tl.load(Real + table + i) != 0)
        k = tl.load(K + g * stride_kg + tokens[:, None] * stride_kn + dims[None, :], mask=ok[:, None], other=0.0)
        v = tl.load(V + g * stride_kg + tokens[:, None] * stride_kn + dims[None, :], mask=ok[:, None], other=0.0)
        if COUNT_TRAFFIC:
            rows = tl.sum(ok.to(tl.int64))
            tl.atomic_add(counters + 0, rows * HEAD_DIM * ELEM)
            tl.atomic_add(counters + 1, rows * HEAD_DIM * ELEM)
        s = tl.where(ok[None, :], tl.dot(q, tl.trans(k), input_precision="ieee") * scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)   # a block with no visible token adds nothing
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    tl.store(O + (g * GROUP + heads)[:, None] * stride_oh + t * stride_on + dims[None, :], acc / l_i[:, None],
             mask=head_ok[:, None])


def selected_attention(q, k, v, blocks, real, sel_block, counters=None):
    """q: (H, N, d) fp32; k, v: (G, N, d); blocks, real: (G, N, top_n) from the selection. Returns (H, N, d)."""
    H, n, d = q.shape
    G, top_n = k.shape[0], blocks.shape[-1]
    if q.dtype != torch.float32 or d not in (16, 32, 64, 128) or sel_block < 16 or sel_block & (sel_block - 1):
        raise ValueError(f"float32, head_dim in 16..128 and a power-of-two sel_block >= 16 (got {q.dtype}, {d}, {sel_block})")
    home = q.device
    device = torch.device("cuda") if torch.cuda.is_available() else home  # natively where there is a GPU
    q, k, v = (x.to(device).contiguous() for x in (q, k, v))
    blocks, real = blocks.to(device, torch.int32).contiguous(), real.to(device, torch.int32).contiguous()
    out = torch.empty_like(q)
    cnt = torch.zeros(len(TENSORS), dtype=torch.int64, device=device)
    group = H // G
    _selected_kernel[(n, G)](q, k, v, blocks, real, out, cnt, d ** -0.5,
                             q.stride(0), q.stride(1), k.stride(0), k.stride(1), blocks.stride(0), blocks.stride(1),
                             out.stride(0), out.stride(1), GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)),
                             TOP_N=top_n, SEL_BLOCK=sel_block, HEAD_DIM=d, ELEM=q.element_size(),
                             COUNT_TRAFFIC=counters is not None)
    if counters is not None:
        counters += cnt.to(counters.device)
    return out.to(home)


def selected_reference(q, k, v, blocks, real, sel_block):
    """The same branch as dense attention: SDPA over every key, masked to the selected blocks' tokens up to the query."""
    H, n, _ = q.shape
    G = k.shape[0]
    t = torch.arange(n, device=q.device)
    starts = blocks * sel_block                                                       # (G, N, top_n)
    in_block = (t[None, None, None, :] >= starts[..., None]) & (t[None, None, None, :] < starts[..., None] + sel_block)
    mask = (in_block & real[..., None]).any(2) & (t[None, :, None] >= t[None, None, :])  # (G, N, N)
    expand = lambda x: x.repeat_interleave(H // G, 0)  # noqa: E731
    return F.scaled_dot_product_attention(q, expand(k), expand(v), attn_mask=expand(mask))
