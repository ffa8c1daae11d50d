"""Run a fusion plan for real: generated Triton kernels for the groups, library calls for the extern ops,
views as strided aliases, every intermediate buffer at its planned offset in one arena.

Measured per run: kernels launched, and for each generated kernel the bytes it requested and the distinct
bytes it touched (from the COUNT shadow arrays). Library calls cannot be instrumented; their bytes are
modelled as inputs plus output. If the memory plan let two live buffers share bytes, the outputs would be
wrong, so comparing with eager PyTorch also checks the plan.
"""
from __future__ import annotations

import dataclasses
import time

import networkx as nx
import torch

from backend.graph import ir, memory_plan
from backend.graph.codegen import GeneratedKernel, generate
from backend.graph.passes import FusionPlan


@dataclasses.dataclass
class Step:
    kind: str                  # "kernel" | "extern" | "view"
    key: object                # group id, or node name
    label: str


def _span(t: torch.Tensor) -> int:
    return 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 0) if t.numel() else 1


class FusedProgram:
    def __init__(self, g: nx.DiGraph, plan: FusionPlan):
        self.g, self.plan = g, plan
        self.kernels: dict[int, GeneratedKernel] = {gid: generate(g, plan, gid) for gid in plan.groups}
        self.steps = self._schedule()
        self.memory = self._plan_memory()

    def _unit(self, n):
        kind = ir.get(self.g, n).kind
        if n in self.plan.group:
            return ("kernel", self.plan.group[n])
        if kind == "opaque":
            return ("extern", n)
        if kind == "view":
            return ("view", n)
        return None

    def _schedule(self) -> list[Step]:
        g = self.g
        position = {n: i for i, n in enumerate(nx.topological_sort(g))}
        units = nx.DiGraph()
        first = {}
        for n in g.nodes:
            u = self._unit(n)
            if u is not None:
                units.add_node(u)
                first[u] = min(first.get(u, position[n]), position[n])
        for a, b in g.edges:
            ua, ub = self._unit(a), self._unit(b)
            if ua is not None and ub is not None and ua != ub:
                units.add_edge(ua, ub)
        order = nx.lexicographical_topological_sort(units, key=lambda u: first[u])
        steps = []
        for kind, key in order:
            label = self.kernels[key].name if kind == "kernel" else f"{ir.get(g, key).op} ({key})"
            steps.append(Step(kind, key, label))
        return steps

    def _writes(self, step: Step) -> list[str]:
        if step.kind == "kernel":
            return self.kernels[step.key].outputs
        return [step.key] if step.kind == "extern" else []

    def _reads(self, step: Step) -> list[str]:
        if step.kind == "kernel":
            return self.kernels[step.key].inputs
        return list(self.g.predecessors(step.key))

    def base(self, n: str) -> str:
        """The buffer a view aliases."""
        while ir.get(self.g, n).kind == "view" and n not in self.plan.group:
            n = next(iter(self.g.predecessors(n)))
        return n

    def _plan_memory(self) -> memory_plan.MemoryPlan:
        outputs = set(self.g.graph["outputs"])
        start, end = {}, {}
        for i, step in enumerate(self.steps):
            for n in self._writes(step):
                if n not in outputs and ir.get(self.g, n).bytes > 0:
                    start[n], end[n] = i, i
            for n in self._reads(step):
                b = self.base(n)
                if b in start:
                    end[b] = max(end[b], i)
        # a graph output that is a view of an intermediate keeps it alive to the end
        for o in outputs:
            b = self.base(o)
            if b in start:
                end[b] = len(self.steps) - 1
        buffers = [memory_plan.Buffer(n, ir.get(self.g, n).bytes, start[n], end[n]) for n in start]
        return memory_plan.plan(buffers, len(self.steps))

    def run(self, inputs: list[torch.Tensor], count: bool = False) -> tuple[list[torch.Tensor], dict]:
        g = self.g
        env = dict(zip(g.graph["inputs"], inputs))
        device = inputs[0].device
        arena = torch.empty(max(self.memory.arena_bytes, 1), dtype=torch.uint8, device=device)
        outputs = set(g.graph["outputs"])

        def buffer(n):
            node = ir.get(g, n)
            dtype = getattr(torch, node.dtype)
            if n in outputs or n not in self.memory.offsets:
                return torch.empty(node.shape, dtype=dtype, device=device)
            off = self.memory.offsets[n]
            return arena[off:off + node.bytes].view(dtype).view(node.shape)

        dummy = torch.zeros(1, dtype=torch.int32, device=device)
        launches, per_kernel, extern_bytes, timeline = 0, [], 0, []
        started = time.perf_counter()
        for step in self.steps:
            t0 = time.perf_counter()
            self._run_step(step, env, buffer, dummy, count, per_kernel)
            if step.kind != "view":
                launches += 1
                timeline.append({"step": step.label, "kind": step.kind, "start_us": (t0 - started) * 1e6,
                                 "dur_us": (time.perf_counter() - t0) * 1e6})
            if step.kind == "extern":
                extern_bytes += sum(ir.get(g, p).bytes for p in set(g.predecessors(step.key))) + ir.get(g, step.key).bytes
        seconds = time.perf_counter() - started
        result = []
        for o in g.graph["outputs"]:
            t = env[o]
            result.append(t.clone() if self.base(o) in self.memory.offsets else t)  # never hand out the arena
        return result, {"launches": launches, "generated_kernels": sum(s.kind == "kernel" for s in self.steps),
                        "extern_kernels": sum(s.kind == "extern" for s in self.steps), "per_kernel": per_kernel,
                        "extern_modelled_bytes": extern_bytes, "seconds": seconds, "timeline": timeline}

    def _run_step(self, step: Step, env: dict, buffer, dummy, count: bool, per_kernel: list) -> None:
        g = self.g
        if step.kind == "view":
            env[step.key] = ir.get(g, step.key).run(env)
            return
        if step.kind == "extern":
            result = ir.get(g, step.key).run(env)
            if isinstance(result, torch.Tensor):
                out = buffer(step.key)
                out.copy_(result)
                result = out
            env[step.key] = result
            return
        k = self.kernels[step.key]
        ins = [env[x] for x in k.inputs]
        for x, t in zip(k.inputs, ins):
            meta = ir.get(g, x)
            if tuple(t.shape) != meta.shape or (t.numel() > 1 and tuple(t.stride()) != meta.stride):
                raise RuntimeError(f"{k.name}: {x} has shape {tuple(t.shape)} strides {tuple(t.stride())}, "
                                   f"the kernel was generated for {meta.shape} {meta.stride}")
        outs = [buffer(n) for n in k.outputs]
        shadows = [torch.zeros(_span(t), dtype=torch.int32, device=dummy.device) if count else dummy for t in ins + outs]
        k.fn[(k.grid,)](*ins, *outs, *shadows, COUNT=count, BLOCK=k.block)
        for n, t in zip(k.outputs, outs):
            env[n] = t
        if count:
            tensors = ins + outs
            requested = sum(int(s.sum()) * t.element_size() for s, t in zip(shadows, tensors))
            unique = sum(int((s > 0).sum()) * t.element_size() for s, t in zip(shadows, tensors))
            per_kernel.append({"kernel": k.name, "template": k.template, "requested_bytes": requested, "unique_bytes": unique})
