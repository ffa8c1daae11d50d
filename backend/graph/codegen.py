"""Generate one Triton kernel per fused group, from two templates, and load it.

pointwise: a 1D grid of blocks over the rows × columns elements; every value is a vector of the block.
reduction: one program per row (axis 1) or per column (axis 0). In the persistent form the whole reduced
axis is one block, so a reduction's result is a per-program scalar the rest of the kernel can reuse (LayerNorm
in one pass). In the looped form the axis is walked in blocks, accumulating, and only per-program scalars
may follow the reduction.

Shapes and strides are baked in as literals (static shapes, as TorchInductor does). With COUNT=True every
load and store also adds 1 to a per-buffer int32 shadow array at the same offsets: the launch then tells
how many bytes the kernel requested and how many distinct bytes it touched.
"""
from __future__ import annotations

import dataclasses
import hashlib
import importlib.util
import sys
import tempfile
from pathlib import Path

import networkx as nx

import kernels  # noqa: F401  (selects Triton's interpreter on a CPU before triton is imported)
from backend.graph.capture import Ref
from backend.graph.passes import FusionPlan, group_io, to2d, varies
from backend.graph.triton_ops import POINTWISE, lit

CACHE = Path(tempfile.gettempdir()) / "explorer_generated_kernels"


@dataclasses.dataclass
class GeneratedKernel:
    gid: int
    name: str
    template: str
    source: str
    inputs: list[str]          # graph nodes read from memory, in argument order
    outputs: list[str]         # graph nodes written to memory
    domain: tuple[int, int]
    axis: int | None
    block: int
    grid: int
    fn: object = None


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def _strides_2d(shape, stride) -> tuple[int, int]:
    """Element strides over the kernel's (row, column) space for a tensor broadcast to it (0 = broadcast)."""
    shape, stride = tuple(shape), tuple(stride)
    shape2 = ((1, 1) + shape)[-2:] if len(shape) < 2 else shape
    stride2 = ((0, 0) + stride)[-2:] if len(stride) < 2 else stride
    return tuple(s if n > 1 else 0 for n, s in zip(shape2, stride2))


def _output_strides(g, n) -> tuple[int, int]:
    """Outputs are contiguous; a reduction's result is indexed by the axis it kept, even without keepdim."""
    axes = varies(g, n)
    cols = to2d(g.nodes[n]["shape"])[1]
    if axes == {0, 1}:
        return (cols, 1)
    return (1 if 0 in axes else 0, 1 if 1 in axes else 0)


def generate(g: nx.DiGraph, plan: FusionPlan, gid: int) -> GeneratedKernel:
    grp = plan.groups[gid]
    members = grp.members
    order = [n for n in nx.topological_sort(g) if n in members]
    inputs, outputs = group_io(g, order)
    R, C = grp.domain
    template = plan.template(gid)
    axis = grp.axis
    inner = None if axis is None else (R, C)[axis]
    looped = template == "looped reduction"
    block = _next_pow2(inner) if template == "persistent reduction" else \
        (min(_next_pow2(plan.block_limit), _next_pow2(inner)) if looped else min(1024, _next_pow2(R * C)))
    grid = (-(-R * C // block)) if axis is None else (R, C)[1 - axis]
    ops = "_".join(dict.fromkeys(g.nodes[n]["op"] for n in order if g.nodes[n]["op"] != "getitem"))[:48]
    name = f"k{gid}_{ops}"

    def is_vector(axes) -> bool:
        return axis is None or axis in axes

    var = {}          # node -> expression name
    form = {}         # node -> "vector" | "scalar"
    args = [f"in{i}" for i in range(len(inputs))] + [f"out{i}" for i in range(len(outputs))]
    counters = [f"cnt{i}" for i in range(len(args))]
    pre, body, post = [], [], []   # before the loop, in it (vectors), after it (looped form only)

    def index(sr, sc, vector):
        terms = []
        if vector or axis is None:
            terms = [f"r * {sr}" if sr else "", f"c * {sc}" if sc else ""]
        else:
            terms = [f"r * {sr}" if axis == 1 and sr else "", f"c * {sc}" if axis == 0 and sc else ""]
        terms = [t for t in terms if t]
        return " + ".join(terms) if terms else ("offs * 0" if axis is None else ("i * 0" if vector else "0"))

    def count(lines, ptr, idx, vector):
        m = ", mask=mask" if vector else ""
        lines += ["if COUNT:", f"    tl.atomic_add({ptr} + {idx}, 1{m})"]

    for k, x in enumerate(inputs):
        d = g.nodes[x]
        sr, sc = _strides_2d(d["shape"], d["stride"])
        vec = is_vector({ax for ax, s in enumerate((sr, sc)) if s})
        idx = index(sr, sc, vec)
        lines = body if (vec and looped) else pre
        m = ", mask=mask, other=0.0" if vec else ""
        lines.append(f"x{k} = tl.load(in{k} + {idx}{m})  # {x} {list(d['shape'])}")
        count(lines, f"cnt{k}", idx, vec)
        var[x], form[x] = f"x{k}", "vector" if vec else "scalar"

    def arg(a):
        if isinstance(a, Ref):
            return var[a.name]
        return lit(a)

    def depends_on_reduction(n):
        return any(g.nodes[a]["kind"] == "reduction" for a in nx.ancestors(g, n) | {n} if a in members)

    for n in order:
        d = g.nodes[n]
        op = d["op"]
        v = f"v_{n}"
        if op == "getitem":
            src, idx = d["args"]
            var[n], form[n] = f"{var[src.name]}_{idx}", "scalar" if axis is not None else "vector"
            continue
        if d["kind"] == "reduction":
            e = var[d["args"][0].name]
            if form[d["args"][0].name] == "scalar":
                e = f"({e} + tl.zeros([BLOCK], tl.float32))"
            n_el = (R, C)[axis]
            kw = dict(d["kwargs"])
            if looped:
                acc = f"acc_{n}"
                if op == "sum":
                    pre.append(f"{acc} = tl.zeros([BLOCK], tl.float32)")
                    body.append(f"{acc} += tl.where(mask, {e}, 0.0)")
                if op == "var_mean":  # Welford per lane, then Chan's formula across lanes (as Inductor's welford)
                    corr = kw.get("correction", 1)
                    pre += [f"{acc}_n = tl.zeros([BLOCK], tl.float32)", f"{acc}_mean = tl.zeros([BLOCK], tl.float32)",
                            f"{acc}_m2 = tl.zeros([BLOCK], tl.float32)"]
                    body += [f"{acc}_n += tl.where(mask, 1.0, 0.0)",
                             f"{acc}_d = tl.where(mask, {e} - {acc}_mean, 0.0)",
                             f"{acc}_mean += {acc}_d / tl.maximum({acc}_n, 1.0)",
                             f"{acc}_m2 += {acc}_d * tl.where(mask, {e} - {acc}_mean, 0.0)"]
                    post += [f"{v}_1 = tl.sum({acc}_mean * {acc}_n, axis=0) / {n_el}.0",
                             f"{v}_0 = (tl.sum({acc}_m2, axis=0) + tl.sum({acc}_n * ({acc}_mean - {v}_1) * ({acc}_mean - {v}_1), "
                             f"axis=0)) / {float(n_el - corr)}"]
                elif op == "sum":
                    post.append(f"{v} = tl.sum({acc}, axis=0)")
                else:
                    fill, red = ('float("-inf")', "tl.max") if op == "amax" else ('float("inf")', "tl.min")
                    cmp = "tl.maximum" if op == "amax" else "tl.minimum"
                    pre.append(f"{acc} = tl.full([BLOCK], {fill}, tl.float32)")
                    body.append(f"{acc} = {cmp}({acc}, tl.where(mask, {e}, {fill}))")
                    post.append(f"{v} = {red}({acc}, axis=0)")
            else:
                lines = body
                if op == "sum":
                    lines.append(f"{v} = tl.sum(tl.where(mask, {e}, 0.0), axis=0)")
                elif op in ("amax", "amin"):
                    fill, red = ('float("-inf")', "tl.max") if op == "amax" else ('float("inf")', "tl.min")
                    lines.append(f"{v} = {red}(tl.where(mask, {e}, {fill}), axis=0)")
                else:  # var_mean -> (var, mean), two passes over the row held in registers
                    corr = kw.get("correction", 1)
                    lines.append(f"{v}_1 = tl.sum(tl.where(mask, {e}, 0.0), axis=0) / {n_el}.0")
                    lines.append(f"{v}_d = tl.where(mask, {e} - {v}_1, 0.0)")
                    lines.append(f"{v}_0 = tl.sum({v}_d * {v}_d, axis=0) / {float(n_el - corr)}")
            var[n], form[n] = v, "scalar"
        else:
            if op not in POINTWISE:
                raise ValueError(f"no template for {op}")
            expr = POINTWISE[op](*[arg(a) for a in d["args"]])
            vec = axis is None or any(form.get(a.name) == "vector" for a in d["args"] if isinstance(a, Ref))
            if axis is not None and not vec and axis in varies(g, n):
                vec = True  # a fill shaped like the row
                expr = f"({expr} + tl.zeros([BLOCK], tl.float32))"
            if looped:
                lines = body if vec else (post if depends_on_reduction(n) else pre)
            else:
                lines = body
            lines.append(f"{v} = {expr}")
            var[n], form[n] = v, "vector" if vec else "scalar"

    for k, n in enumerate(outputs):
        sr, sc = _output_strides(g, n)
        vec = form[n] == "vector"
        idx = index(sr, sc, vec)
        if looped:
            lines = body if vec else post
        else:
            lines = body
        m = ", mask=mask" if vec else ""
        lines.append(f"tl.store(out{k} + {idx}, {var[n]}{m})  # {n} {list(g.nodes[n]['shape'])}")
        count(lines, f"cnt{len(inputs) + k}", idx, vec)

    src = ["import triton", "import triton.language as tl", "", "", "@triton.jit",
           f"def {name}({', '.join(args + counters)}, COUNT: tl.constexpr, BLOCK: tl.constexpr):"]
    ind = "    "
    if axis is None:
        head = ["pid = tl.program_id(0)", "offs = pid * BLOCK + tl.arange(0, BLOCK)", f"mask = offs < {R * C}",
                f"r = offs // {C}", f"c = offs % {C}"]
        src += [ind + line for line in head + pre + body]
    else:
        outer, inner_var = ("r", "c") if axis == 1 else ("c", "r")
        head = [f"{outer} = tl.program_id(0)"]
        if looped:
            src += [ind + line for line in head + pre]
            src += [ind + f"for start in range(0, {inner}, BLOCK):",
                    ind * 2 + "i = start + tl.arange(0, BLOCK)", ind * 2 + f"mask = i < {inner}", ind * 2 + f"{inner_var} = i"]
            src += [ind * 2 + line for line in body]
            src += [ind + line for line in post]
        else:
            head += ["i = tl.arange(0, BLOCK)", f"mask = i < {inner}", f"{inner_var} = i"]
            src += [ind + line for line in head + pre + body]
    source = "\n".join(src) + "\n"
    kern = GeneratedKernel(gid, name, template, source, inputs, outputs, (R, C), axis, block, grid)
    kern.fn = load(source, name)
    return kern


def load(source: str, name: str):
    """Write the source to a file and import it: triton.jit reads a kernel's source from its file."""
    CACHE.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha1(source.encode()).hexdigest()[:16]
    path = CACHE / f"{name}_{digest}.py"
    if not path.exists():
        tmp = path.with_suffix(".tmp")
        tmp.write_text(source)
        tmp.replace(path)
    mod_name = f"explorer_generated_{digest}"
    if mod_name not in sys.modules:
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[mod_name] = module
    return getattr(sys.modules[mod_name], name)
