"""graph.fusion: capture a model's forward and backward as an aten DAG, run the passes, generate one Triton
kernel per fused group, run the fused program, and measure it against the unfused one and eager PyTorch.

Pipeline: capture (make_fx joint graph, tangent as an input) -> dce -> cse -> constant folding ->
save-or-recompute (min cut) -> vertical and horizontal fusion -> Triton codegen -> memory plan -> run.
Measured: kernels launched and bytes each generated kernel requested and touched (COUNT shadow arrays), for
the fused program and for one kernel per op (no passes), both checked against eager PyTorch (outputs and
gradients); the memory plan's arena against its lower bound; TorchInductor's kernel counts on the same
function, when asked.
"""
from __future__ import annotations

import dataclasses

import networkx as nx
import torch

from backend.config import Config, ConfigError, setting
from backend.limits import cost
from backend.experiments import define
from backend.graph import expr, ir
from backend.graph.capture import capture, to_networkx
from backend.graph.dot import to_dot
from backend.graph.models import MODELS, model
from backend.graph.passes import constant_fold, cse, dce, fuse, modelled_bytes, unfused_plan
from backend.graph.recompute import min_cut
from backend.graph.runtime import FusedProgram
from backend.result import Check, Result, Schema

KIND_COLOR = {"pointwise": "#dbe8fb", "reduction": "#fde3d9", "view": "#eeeeee", "opaque": "#e2f0d9", "input": "#ffffff"}


@dataclasses.dataclass
class FusionConfig(Config):
    model: str = setting("ln_gelu", choices=MODELS + ("expression",), help="what to capture")
    expression: str = setting("gelu(layer_norm(x) * w + b)", help="used when model = expression: numbers, x y (rows×width), "
                              "w b (width), W V (width×width), + - * / ** @, exp log sqrt rsqrt tanh sigmoid relu gelu "
                              "erf abs silu maximum minimum softmax layer_norm sum mean max")
    backward: bool = setting(True, help="capture the joint forward + backward graph")
    rows: int = setting(4, min=1, max=64, help="rows of the input (Triton's interpreter runs the kernels on a CPU)")
    width: int = setting(8, min=2, max=64, help="feature width")
    dce: bool = setting(True, help="dead-code elimination")
    cse: bool = setting(True, help="common-subexpression elimination")
    fold: bool = setting(True, help="constant folding and algebraic simplification")
    recompute: bool = setting(True, help="min-cut choice of what the backward recomputes instead of saving")
    vertical: bool = setting(True, help="fuse producers into consumers")
    horizontal: bool = setting(True, help="fuse siblings that read the same input")
    block_limit: int = setting(1024, min=2, max=4096, help="longest reduced axis one block holds (a persistent reduction)")
    inductor: bool = setting(False, help="also compile with torch.compile and count TorchInductor's kernels (about 20 s)")

    cost_drivers = ("rows", "width", "inductor")

    def estimate(self):
        """Triton's interpreter runs each generated kernel once per row (~20 ms of CPU a row at width 64; tracing and the
        first kernels ~2 s: 2.5 s of CPU at the defaults, 5.1 s at 64 x 64 measured); Inductor, when asked, compiles with a C++
        toolchain (the dominant cost: tens of seconds and a compiler's memory)."""
        passes = 2 if self.backward else 1
        return cost(data_bytes=self.rows * self.width * 4 * 400 + (1536 << 20 if self.inductor else 0),
                    ops=passes * self.rows * (450 + 6 * self.width) + 76_000, seconds=60 if self.inductor else 0)

    def check(self) -> None:
        if self.model == "expression":
            try:
                expr.compile_expression(self.expression, self.rows, self.width)
            except expr.ExprError as e:
                raise ConfigError("expression", str(e)) from None


def build(config: FusionConfig):
    if config.model == "expression":
        return expr.compile_expression(config.expression, config.rows, config.width)
    return model(config.model, config.rows, config.width)


def eager(fn, inputs, tangent):
    args = [t.clone().requires_grad_(tangent is not None) for t in inputs]
    with torch.enable_grad():
        out = fn(*args)
        if tangent is None:
            return [out.detach()]
        grads = torch.autograd.grad(out, args, tangent)
    return [out.detach()] + [gr.detach() for gr in grads]


def max_error(got, want) -> float:
    return max(((a.cpu().double() - b.cpu().double()).abs().max() / (1 + b.cpu().double().abs().max())).item()
               for a, b in zip(got, want))


def coverage_error(program: FusedProgram, run: dict, ideal: dict) -> float:
    """Largest |touched − planned| / planned bytes over the generated kernels: 0 when every kernel read each
    input element and wrote each output element of its group (a mask or index bug leaves some untouched)."""
    gids = [s.key for s in program.steps if s.kind == "kernel"]
    return max((abs(k["unique_bytes"] - ideal[gid]) / max(ideal[gid], 1) for k, gid in zip(run["per_kernel"], gids)),
               default=0.0)


def lower(captured: nx.DiGraph, config: FusionConfig):
    """The passes the config turns on, in order; returns the graph, its fusion plan, the log, what is saved."""
    g, log, saved = captured, [], None
    for enabled, name, pass_fn in ((config.dce, "dce", dce), (config.cse, "cse", cse), (config.fold, "fold", constant_fold)):
        if enabled:
            g, entries = pass_fn(g)
            log += entries or [f"{name}: nothing to do"]
    if config.backward and config.recompute:
        g, entries, saved = min_cut(g)
        log += entries
    plan = fuse(g, config.vertical, config.horizontal, config.block_limit)
    return g, plan, log + plan.log, saved


def run(config: FusionConfig, ctx) -> Result:
    """The model captured, lowered by the chosen passes and run twice as generated kernels (one per op, then fused),
    each counted and checked against eager PyTorch in float64; TorchInductor's counts on request; the fused
    program's launches timed as a trace."""
    fn, inputs = build(config)
    ctx.progress(0.05, "capturing the graph")
    captured, feeds, tangent, reference, eager_error = capture_with_reference(config, fn, inputs)
    g, plan, log, saved = lower(captured, config)
    ctx.progress(0.2, "generating and running one kernel per op")
    before = FusedProgram(captured, unfused_plan(captured))
    before_out, before_run = before.run(feeds, count=True)
    ctx.progress(0.55, "generating and running the fused kernels")
    after = FusedProgram(g, plan)
    after_out, after_run = after.run(feeds, count=True)
    ideal = modelled_bytes(g, plan)
    coverage = max(coverage_error(before, before_run, modelled_bytes(captured, before.plan)["per_group"]),
                   coverage_error(after, after_run, ideal["per_group"]))
    kernels = kernel_rows(g, plan, after, after_run, ideal)
    inductor = None
    if config.inductor:
        ctx.progress(0.7, "compiling with TorchInductor")
        from backend.graph.inductor import kernel_counts
        inductor = kernel_counts(fn, inputs, tangent, "cuda" if torch.cuda.is_available() else "cpu")
    errors = {"error_fused_vs_fp64": max_error(after_out, reference), "error_eager_fp32_vs_fp64": eager_error}
    metrics = fusion_metrics(config, captured, g, plan, after, (before_run, after_run), ideal, kernels, errors, saved,
                             inductor)
    tolerance = 2 * eager_error + 1e-6
    checks = fusion_checks(max_error(after_out, reference), max_error(before_out, reference), tolerance, eager_error,
                           coverage, after)
    if inductor:
        checks.append(Check("TorchInductor's compiled function = PyTorch, within 2× eager fp32's own error",
                            max_error(inductor["values"], reference), tolerance, reference="eager PyTorch in float64"))
    notes = ["Kernels run in Triton's interpreter on a CPU: bytes are counted exactly, times mean nothing."
             if not torch.cuda.is_available() else "Kernels ran on the GPU."]
    if inductor and "cpp" in inductor["backend"]:
        notes.append("TorchInductor here is its C++ CPU backend (no GPU): its loop nests may compute a row and a column "
                     "reduction in one kernel, which a Triton kernel cannot. bench/fusion.py counts its Triton kernels on a GPU.")
    return Result(metrics=metrics, tables=fusion_tables(config, g, plan, after, log, kernels, saved), checks=checks,
                  notes=notes, trace_events=launch_timeline(after, feeds))


def capture_with_reference(config: FusionConfig, fn, inputs):
    """The captured graph (with its backward when asked, the incoming gradient a seeded input), the feeds on the
    device the generated kernels run on, and eager PyTorch's result in float64 with fp32's own error against it."""
    gm = capture(fn, inputs, config.backward)
    captured = to_networkx(gm, config.backward)
    tangent = torch.randn(ir.get(captured, captured.graph["inputs"][-1]).shape, generator=torch.Generator().manual_seed(1)) \
        if config.backward else None
    device = "cuda" if torch.cuda.is_available() else "cpu"  # the generated kernels run where the tensors are
    feeds = [t.to(device) for t in inputs + ([tangent] if config.backward else [])]
    reference = eager(fn, [t.double() for t in inputs], tangent.double() if tangent is not None else None)
    eager_error = max_error(eager(fn, inputs, tangent), reference)  # what fp32 itself costs
    return captured, feeds, tangent, reference, eager_error


def kernel_rows(g: nx.DiGraph, plan, after: FusedProgram, after_run: dict, ideal: dict) -> list[dict]:
    """One row per launch of the fused program: a generated kernel's counted bytes beside its group's ideal, or a
    library call's modelled bytes."""
    kernels = []
    by_name = {k["kernel"]: k for k in after_run["per_kernel"]}
    for step in after.steps:
        if step.kind == "kernel":
            k = after.kernels[step.key]
            grp = plan.groups[step.key]
            measured = by_name[k.name]
            group_ideal = ideal["per_group"][step.key]
            kernels.append({"kernel": k.name, "phase": grp.phase, "template": k.template, "ops": len(grp.members),
                            "grid": k.grid, "block": k.block, "requested_bytes": measured["requested_bytes"],
                            "unique_bytes": measured["unique_bytes"], "ideal_bytes": group_ideal,
                            "unique_over_ideal": round(measured["unique_bytes"] / max(group_ideal, 1), 3)})
        elif step.kind == "extern":
            node = ir.get(g, step.key)
            kernels.append({"kernel": f"{node.op} ({step.key})", "phase": node.phase, "template": "library call", "ops": 1,
                            "grid": None, "block": None, "requested_bytes": None, "unique_bytes": None,
                            "ideal_bytes": sum(ir.get(g, p).bytes for p in set(g.predecessors(step.key))) + node.bytes,
                            "unique_over_ideal": None})
    return kernels


def fusion_metrics(config: FusionConfig, captured, g, plan, after: FusedProgram, runs: tuple[dict, dict], ideal: dict,
                   kernels: list[dict], errors: dict, saved: dict | None, inductor: dict | None) -> dict:
    """Launches, generated kernels per phase, bytes counted against the ideal, the errors, the arena against its
    bounds, ops before and after the passes, and what min-cut and TorchInductor found. `runs`: the one-per-op and
    fused runs."""
    before_run, after_run = runs

    def phase_count(phase):
        return sum(1 for s in after.steps if s.kind == "kernel" and plan.groups[s.key].phase == phase)

    mem = after.memory
    ops = lambda graph: sum(1 for _, node in ir.items(graph) if node.kind in ("pointwise", "reduction", "opaque"))  # noqa: E731
    metrics = {
        "model": config.model if config.model != "expression" else f"expression: {config.expression}",
        "backward": config.backward,
        "kernels_unfused": before_run["launches"], "kernels_fused": after_run["launches"],
        "generated_kernels_unfused": before_run["generated_kernels"], "generated_kernels_fused": after_run["generated_kernels"],
        "generated_forward": phase_count("forward"), "generated_backward": phase_count("backward"),
        "extern_kernels": after_run["extern_kernels"],
        "bytes_unfused": sum(k["unique_bytes"] for k in before_run["per_kernel"]),
        "bytes_fused": sum(k["unique_bytes"] for k in after_run["per_kernel"]),
        "requested_bytes_fused": sum(k["requested_bytes"] for k in after_run["per_kernel"]),
        "ideal_unique_bytes": ideal["ideal_unique_bytes"],
        "extern_modelled_bytes": after_run["extern_modelled_bytes"],
        "worst_group_unique_over_ideal": max((k["unique_over_ideal"] for k in kernels if k["unique_over_ideal"] is not None),
                                             default=0.0),
        **errors,
        "arena_bytes": mem.arena_bytes, "lower_bound_bytes": mem.lower_bound_bytes, "no_reuse_bytes": mem.no_reuse_bytes,
        "ops_captured": ops(captured), "ops_after_passes": ops(g),
    }
    if saved:
        metrics.update(saved_bytes_naive=saved["saved_bytes_before"], saved_bytes_min_cut=saved["saved_bytes_after"])
    if inductor:
        metrics.update(inductor_backend=inductor["backend"], inductor_forward_kernels=inductor["forward_kernels"],
                       inductor_backward_kernels=inductor["backward_kernels"], inductor_extern_calls=inductor["extern_calls"])
    return metrics


def fusion_tables(config: FusionConfig, g, plan, after: FusedProgram, log: list[str], kernels: list[dict],
                  saved: dict | None) -> dict:
    """The passes' log, why each pair was left apart, the kernels and their sources, the memory plan over time,
    the graph per phase and what the backward keeps."""
    mem = after.memory
    labels = {i: s.label for i, s in enumerate(after.steps)}
    return {
        "log": [{"pass": e.split(":")[0], "what and why": e.split(":", 1)[1].strip()} for e in log],
        "why_not": plan.rejected,
        "kernels": kernels,
        "sources": [{"kernel": k.name, "template": k.template, "source": k.source} for k in after.kernels.values()],
        "memory_plan": [{"buffer": b.name, "bytes": b.nbytes, "offset": mem.offsets[b.name], "first_step": b.start,
                         "last_step": b.end, "written_by": labels[b.start]} for b in mem.buffers],
        "memory_over_time": [{"step": i, "kernel": labels[i], "live_bytes": live} for i, live in enumerate(mem.live_bytes)],
        "graph_dot": [{"phase": phase, "dot": phase_dot(g, plan, phase)} for phase in (("forward", "backward") if config.backward else ("forward",))],
        "saved": [{"value": v, "bytes": ir.get(g, v).bytes, "shape": "×".join(map(str, ir.get(g, v).shape))}
                  for v in (saved["saved_after"] if saved else [])],
    }


def fusion_checks(fused_error: float, unfused_error: float, tolerance: float, eager_error: float, coverage: float,
                  after: FusedProgram) -> list[Check]:
    """Both programs against eager PyTorch in float64 (within twice fp32's own error), each kernel's counted bytes
    against its plan, and the arena's lifetimes."""
    return [
        Check("fused program = PyTorch (outputs and gradients), within 2× eager fp32's own error", fused_error,
              tolerance, reference=f"eager PyTorch in float64 (eager fp32 is off by {eager_error:.2e})",
              detail="max |difference| / (1 + max |reference|); generated Triton kernels (interpreter on a CPU) and library "
                     "calls, buffers at their planned offsets"),
        Check("one kernel per op = PyTorch, within 2× eager fp32's own error", unfused_error, tolerance,
              reference="eager PyTorch in float64"),
        Check("every generated kernel touched exactly its group's inputs and outputs, once each", coverage,
              0.0, reference="the plan: each group's external inputs and the values it hands on",
              detail="max |distinct bytes counted by the kernel − planned| / planned, fused and one-per-op programs"),
        Check("no two buffers live at the same time share bytes", len(after.memory.conflicts()), 0, reference="the plan's lifetimes"),
    ]


def launch_timeline(after: FusedProgram, feeds: list) -> list[dict]:
    """The fused program's launches as trace events, from a run without counting (so the times are the kernels' own)."""
    _, timed = after.run(feeds, count=False)
    return [{"name": e["step"], "lane": "generated kernel" if e["kind"] == "kernel" else "library call", "rank": 0,
             "ts": e["start_us"], "dur": e["dur_us"], "args": {}} for e in timed["timeline"]]


def phase_dot(g: nx.DiGraph, plan, phase: str) -> str:
    """The nodes of one phase, with the other phase's values they read drawn dashed; fused groups as clusters."""
    nodes = {n for n, node in ir.items(g) if node.phase == phase and not (phase == "backward" and node.role == "primal")}
    reads = {p for n in nodes for p in g.predecessors(n) if p not in nodes}
    sub = g.subgraph(nodes | reads).copy()
    for n, node in list(ir.items(sub)):  # graphviz attributes beside the node
        shape = "×".join(map(str, node.shape)) or "scalar"
        sub.nodes[n].update(label=f"{n}\n{node.op} [{shape}]" if node.op != "var_mean" else f"{n}\nvar_mean → (var, mean)",
                            fillcolor=KIND_COLOR.get(node.kind, "#ffffff"),
                            tooltip=f"{node.category}, {node.bytes} B" + (f": {node.why_opaque}" if node.why_opaque else ""))
        if n in reads:
            sub.nodes[n].update(style="rounded,filled,dashed",
                                tooltip=f"read from the {'forward' if phase == 'backward' else 'backward'}: {node.bytes} B")
    text = to_dot(sub, rankdir="TB").rstrip().rstrip("}")
    clusters: dict[int, list[str]] = {}
    for n in nodes:
        if n in plan.group:
            clusters.setdefault(plan.group[n], []).append(n)
    for gid, members in sorted(clusters.items()):
        text += (f'  subgraph cluster_{gid} {{ label="kernel {gid} ({plan.template(gid)})"; style=dashed; '
                 + " ".join(f'"{n}";' for n in sorted(members)) + " }\n")
    return text + "}"


RESULT = Schema(
    metrics=(
        "model", "backward", "kernels_unfused", "kernels_fused", "generated_kernels_unfused",
        "generated_kernels_fused", "generated_forward", "generated_backward", "extern_kernels", "bytes_unfused",
        "bytes_fused", "requested_bytes_fused", "ideal_unique_bytes", "extern_modelled_bytes",
        "worst_group_unique_over_ideal", "error_fused_vs_fp64", "error_eager_fp32_vs_fp64", "arena_bytes",
        "lower_bound_bytes", "no_reuse_bytes", "ops_captured", "ops_after_passes", "saved_bytes_naive",
        "saved_bytes_min_cut", "inductor_backend", "inductor_forward_kernels", "inductor_backward_kernels",
        "inductor_extern_calls",
    ),
    tables={
        "log": ("pass", "what and why"),
        "why_not": ("consumer", "kind", "producer", "why not"),
        "kernels": ("block", "grid", "ideal_bytes", "kernel", "ops", "phase", "requested_bytes", "template",
                    "unique_bytes", "unique_over_ideal"),
        "sources": ("kernel", "source", "template"),
        "memory_plan": ("buffer", "bytes", "first_step", "last_step", "offset", "written_by"),
        "memory_over_time": ("kernel", "live_bytes", "step"),
        "graph_dot": ("dot", "phase"),
        "saved": ("bytes", "shape", "value"),
    },
    optional=("saved_bytes_naive", "saved_bytes_min_cut",  # with the backward only
              "inductor_backend", "inductor_forward_kernels", "inductor_backward_kernels", "inductor_extern_calls"),
)

EXPERIMENT = define(__name__, FusionConfig,
         "capture forward+backward; DCE, CSE, folding, min-cut recompute, fusion with why-not reasons; generated Triton "
         "kernels run and counted against one kernel per op, eager PyTorch and TorchInductor",
         run_fn=run, lanes=("generated kernel", "library call"), schema=RESULT)
