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
from backend.graph import ir
from backend.graph.ir import Ref
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
    cols = to2d(ir.get(g, n).shape)[1]
    if axes == {0, 1}:
        return (cols, 1)
    return (1 if 0 in axes else 0, 1 if 1 in axes else 0)


def generate(g: nx.DiGraph, plan: FusionPlan, gid: int) -> GeneratedKernel:
    grp = plan.groups[gid]
    order = [n for n in nx.topological_sort(g) if n in grp.members]
    inputs, outputs = group_io(g, order)
    template = plan.template(gid)
    block, grid = _launch(template, grp.domain, grp.axis, plan.block_limit)
    ops = "_".join(dict.fromkeys(ir.get(g, n).op for n in order if ir.get(g, n).op != "getitem"))[:48]
    name = f"k{gid}_{ops}"
    body = _Body(grp.axis, looped=template == "looped reduction")
    for k, x in enumerate(inputs):
        _load(body, k, x, ir.get(g, x))
    for n in order:
        _compute(g, body, n, grp)
    for k, n in enumerate(outputs):
        _store(g, body, k, f"cnt{len(inputs) + k}", n)
    pointers = [f"in{i}" for i in range(len(inputs))] + [f"out{i}" for i in range(len(outputs))]
    header = _header(name, pointers + [f"cnt{i}" for i in range(len(pointers))])
    (R, C), axis = grp.domain, grp.axis
    if template == "pointwise":
        source = pointwise_kernel(header, R, C, body.loop)
    elif template == "persistent reduction":
        source = persistent_reduction_kernel(header, axis, (R, C)[axis], body.loop)
    else:
        source = looped_reduction_kernel(header, axis, (R, C)[axis], body.before, body.loop, body.after)
    kern = GeneratedKernel(gid, name, template, source, inputs, outputs, (R, C), axis, block, grid)
    kern.fn = load(source, name)
    return kern


def _launch(template: str, domain: tuple[int, int], axis: int | None, block_limit: int) -> tuple[int, int]:
    """(BLOCK, programs): a block of elements per program, or one program per row (column) of a reduction."""
    R, C = domain
    if axis is None:
        block = min(1024, _next_pow2(R * C))
        return block, -(-R * C // block)
    inner = domain[axis]
    block = _next_pow2(inner) if template == "persistent reduction" else min(_next_pow2(block_limit), _next_pow2(inner))
    return block, domain[1 - axis]


# --- the three templates: the code around the body's lines ------------------------------------------------
IND = "    "


def _header(name: str, params: list[str]) -> list[str]:
    return ["import triton", "import triton.language as tl", "", "", "@triton.jit",
            f"def {name}({', '.join(params)}, COUNT: tl.constexpr, BLOCK: tl.constexpr):"]


def pointwise_kernel(header: list[str], rows: int, cols: int, lines: list[str]) -> str:
    """Each program takes BLOCK consecutive elements of the rows × cols space."""
    head = ["pid = tl.program_id(0)", "offs = pid * BLOCK + tl.arange(0, BLOCK)", f"mask = offs < {rows * cols}",
            f"r = offs // {cols}", f"c = offs % {cols}"]
    return "\n".join(header + [IND + line for line in head + lines]) + "\n"


def persistent_reduction_kernel(header: list[str], axis: int, inner: int, lines: list[str]) -> str:
    """Each program takes one row (axis 1) or column (axis 0), whole, as one block."""
    outer, inner_var = ("r", "c") if axis == 1 else ("c", "r")
    head = [f"{outer} = tl.program_id(0)", "i = tl.arange(0, BLOCK)", f"mask = i < {inner}", f"{inner_var} = i"]
    return "\n".join(header + [IND + line for line in head + lines]) + "\n"


def looped_reduction_kernel(header: list[str], axis: int, inner: int, before: list[str], loop: list[str],
                            after: list[str]) -> str:
    """Each program walks one row (axis 1) or column (axis 0) a block at a time, accumulating."""
    outer, inner_var = ("r", "c") if axis == 1 else ("c", "r")
    walk = [f"for start in range(0, {inner}, BLOCK):", IND + "i = start + tl.arange(0, BLOCK)", IND + f"mask = i < {inner}",
            IND + f"{inner_var} = i"]
    return "\n".join(header + [IND + line for line in [f"{outer} = tl.program_id(0)"] + before + walk]
                     + [IND * 2 + line for line in loop] + [IND + line for line in after]) + "\n"


# --- the body: loads, the group's ops, stores -------------------------------------------------------------
@dataclasses.dataclass
class _Body:
    """A kernel's lines, and each node's value in them: a vector (one per element of the block) or a scalar
    (one per program). Only the looped reduction has a loop; the other templates use `loop` alone."""
    axis: int | None
    looped: bool
    before: list = dataclasses.field(default_factory=list)   # before the loop
    loop: list = dataclasses.field(default_factory=list)     # in it: vectors
    after: list = dataclasses.field(default_factory=list)    # after it: what reads a finished reduction
    value: dict = dataclasses.field(default_factory=dict)    # node -> expression name
    vector: dict = dataclasses.field(default_factory=dict)   # node -> is a vector

    def lines(self, vector: bool, after_loop: bool) -> list:
        if not self.looped or vector:
            return self.loop
        return self.after if after_loop else self.before

    def is_vector(self, axes) -> bool:
        """A value varying along these 2D axes is a vector, unless all of them are the program's own row (column)."""
        return self.axis is None or self.axis in axes

    def index(self, sr: int, sc: int, vector: bool) -> str:
        """The element offset of a tensor with 2D strides (sr, sc): a scalar is indexed by the program alone."""
        if vector or self.axis is None:
            terms = [f"r * {sr}" if sr else "", f"c * {sc}" if sc else ""]
        else:
            terms = [f"r * {sr}" if self.axis == 1 and sr else "", f"c * {sc}" if self.axis == 0 and sc else ""]
        terms = [t for t in terms if t]
        return " + ".join(terms) if terms else ("offs * 0" if self.axis is None else ("i * 0" if vector else "0"))


def _counted(ptr: str, idx: str, vector: bool) -> list[str]:
    """With COUNT, add 1 at every offset touched to the buffer's shadow array."""
    return ["if COUNT:", f"    tl.atomic_add({ptr} + {idx}, 1{', mask=mask' if vector else ''})"]


def _load(body: _Body, k: int, x: str, node: ir.Node) -> None:
    """Input k (node x) from pointer in{k} into x{k}, its shadow array cnt{k}."""
    sr, sc = _strides_2d(node.shape, node.stride)
    vec = body.is_vector({ax for ax, s in enumerate((sr, sc)) if s})
    idx = body.index(sr, sc, vec)
    body.lines(vec, after_loop=False).extend(
        [f"x{k} = tl.load(in{k} + {idx}{', mask=mask, other=0.0' if vec else ''})  # {x} {list(node.shape)}"]
        + _counted(f"cnt{k}", idx, vec))
    body.value[x], body.vector[x] = f"x{k}", vec


def _store(g: nx.DiGraph, body: _Body, k: int, counter: str, n: str) -> None:
    """Output k (node n) to pointer out{k}, its shadow array `counter`; a scalar once the loop is done."""
    sr, sc = _output_strides(g, n)
    vec = body.vector[n]
    idx = body.index(sr, sc, vec)
    body.lines(vec, after_loop=True).extend(
        [f"tl.store(out{k} + {idx}, {body.value[n]}{', mask=mask' if vec else ''})  # {n} {list(ir.get(g, n).shape)}"]
        + _counted(counter, idx, vec))


def _compute(g: nx.DiGraph, body: _Body, n: str, grp) -> None:
    node = ir.get(g, n)
    if node.op == "getitem":  # var_mean's (var, mean): v_<tuple>_0, v_<tuple>_1, one per program
        src, idx = node.args
        body.value[n], body.vector[n] = f"{body.value[src.name]}_{idx}", body.axis is None
    elif node.kind == "reduction":
        _reduce(body, n, node, grp.domain[body.axis])
    else:
        _pointwise(g, body, n, node, grp.members)


def _reduce(body: _Body, n: str, node: ir.Node, n_el: int) -> None:
    e = body.value[node.args[0].name]
    if not body.vector[node.args[0].name]:
        e = f"({e} + tl.zeros([BLOCK], tl.float32))"
    correction = dict(node.kwargs).get("correction", 1)
    if body.looped:
        before, loop, after = looped_reduction(node.op, n, e, n_el, correction)
        body.before += before
        body.loop += loop
        body.after += after
    else:
        body.loop += persistent_reduction(node.op, n, e, n_el, correction)
    body.value[n], body.vector[n] = f"v_{n}", False


def _pointwise(g: nx.DiGraph, body: _Body, n: str, node: ir.Node, members: set) -> None:
    if node.op not in POINTWISE:
        raise ValueError(f"no template for {node.op}")
    expr = POINTWISE[node.op](*[body.value[a.name] if isinstance(a, Ref) else lit(a) for a in node.args])
    vec = body.axis is None or any(body.vector.get(a.name) for a in node.args if isinstance(a, Ref))
    if not vec and body.axis in varies(g, n):
        vec = True  # a fill shaped like the row
        expr = f"({expr} + tl.zeros([BLOCK], tl.float32))"
    # in the looped form a scalar is computed before the loop, or after it if it reads the reduction's result
    reads_reduction = any(ir.get(g, a).kind == "reduction" for a in nx.ancestors(g, n) if a in members)
    body.lines(vec, after_loop=reads_reduction).append(f"v_{n} = {expr}")
    body.value[n], body.vector[n] = f"v_{n}", vec


REDUCE = {"sum": ("0.0", "tl.sum"), "amax": ('float("-inf")', "tl.max"), "amin": ('float("inf")', "tl.min")}


def persistent_reduction(op: str, n: str, e: str, n_el: int, correction) -> list[str]:
    """Node n reduces e, whose whole row is in the block: at once; var_mean in two passes over the registers."""
    v = f"v_{n}"
    if op == "var_mean":  # -> v_0 (var), v_1 (mean)
        return [f"{v}_1 = tl.sum(tl.where(mask, {e}, 0.0), axis=0) / {n_el}.0",
                f"{v}_d = tl.where(mask, {e} - {v}_1, 0.0)",
                f"{v}_0 = tl.sum({v}_d * {v}_d, axis=0) / {float(n_el - correction)}"]
    fill, reduce = REDUCE[op]
    return [f"{v} = {reduce}(tl.where(mask, {e}, {fill}), axis=0)"]


def looped_reduction(op: str, n: str, e: str, n_el: int, correction) -> tuple[list[str], list[str], list[str]]:
    """Node n reduces e a block at a time: (before, in, after the loop) lines; per-lane accumulators over the
    blocks, reduced across lanes at the end."""
    v, acc = f"v_{n}", f"acc_{n}"
    if op == "var_mean":  # Welford per lane, then Chan's formula across lanes (as Inductor's welford)
        return ([f"{acc}_n = tl.zeros([BLOCK], tl.float32)", f"{acc}_mean = tl.zeros([BLOCK], tl.float32)",
                 f"{acc}_m2 = tl.zeros([BLOCK], tl.float32)"],
                [f"{acc}_n += tl.where(mask, 1.0, 0.0)",
                 f"{acc}_d = tl.where(mask, {e} - {acc}_mean, 0.0)",
                 f"{acc}_mean += {acc}_d / tl.maximum({acc}_n, 1.0)",
                 f"{acc}_m2 += {acc}_d * tl.where(mask, {e} - {acc}_mean, 0.0)"],
                [f"{v}_1 = tl.sum({acc}_mean * {acc}_n, axis=0) / {n_el}.0",
                 f"{v}_0 = (tl.sum({acc}_m2, axis=0) + tl.sum({acc}_n * ({acc}_mean - {v}_1) * ({acc}_mean - {v}_1), "
                 f"axis=0)) / {float(n_el - correction)}"])
    if op == "sum":
        return [f"{acc} = tl.zeros([BLOCK], tl.float32)"], [f"{acc} += tl.where(mask, {e}, 0.0)"], \
            [f"{v} = tl.sum({acc}, axis=0)"]
    fill, reduce = REDUCE[op]
    combine = "tl.maximum" if op == "amax" else "tl.minimum"
    return [f"{acc} = tl.full([BLOCK], {fill}, tl.float32)"], [f"{acc} = {combine}({acc}, tl.where(mask, {e}, {fill}))"], \
        [f"{v} = {reduce}({acc}, axis=0)"]


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
