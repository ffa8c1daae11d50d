"""graph.fusion: capture a model's forward (and backward) as an aten DAG, run the passes, plan the kernels.

Measured from the captured graph: kernels and global-memory bytes if every op were its own kernel, and after
the fusion plan (each group reads its external inputs once and writes what leaves it), beside the ideal
unique bytes (graph inputs and outputs once). Checked: the captured graph, run on real tensors, equals eager
PyTorch (outputs and gradients); the fusion plan's groups form an acyclic graph of kernels.
This is the plan; generating Triton kernels for the groups is the next step (see the issue).
"""
from __future__ import annotations

import dataclasses

import networkx as nx
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from backend.config import Config, setting
from backend.experiments import register
from backend.graph.capture import DECOMPOSE, capture, to_networkx
from backend.graph.dot import to_dot
from backend.graph.passes import cse, dce, fuse, kernel_stats
from backend.result import Check, Result

KIND_COLOR = {"pointwise": "#dbe8fb", "reduction": "#fde3d9", "view": "#eeeeee", "opaque": "#e2f0d9", "input": "#ffffff", "output": "#ffffff"}


def model(name: str, rows: int, width: int):
    g = torch.Generator().manual_seed(0)
    if name == "ln_gelu":
        def fn(x, w, b):
            return torch.nn.functional.gelu(torch.nn.functional.layer_norm(x, (width,), w, b))
        return fn, [torch.randn(rows, width, generator=g), torch.randn(width, generator=g), torch.randn(width, generator=g)]
    if name == "mlp":
        def fn(x, w1, w2):
            return torch.nn.functional.gelu(x @ w1) @ w2
        return fn, [torch.randn(rows, width, generator=g), torch.randn(width, 2 * width, generator=g), torch.randn(2 * width, width, generator=g)]
    def fn(q, k, v):  # attention
        return torch.softmax(q @ k.T / width ** 0.5, dim=-1) @ v
    return fn, [torch.randn(rows, width, generator=g) for _ in range(3)]


@dataclasses.dataclass
class FusionConfig(Config):
    model: str = setting("ln_gelu", choices=("ln_gelu", "mlp", "attention"), help="what to capture")
    backward: bool = setting(True, help="capture the joint forward + backward graph")
    rows: int = setting(4, min=1, max=256, help="rows of the input")
    width: int = setting(8, min=1, max=256, help="feature width")
    dce: bool = setting(True, help="dead-code elimination")
    cse: bool = setting(True, help="common-subexpression elimination")
    vertical: bool = setting(True, help="fuse producers into consumers")
    horizontal: bool = setting(True, help="fuse siblings that read the same input")


def run(config: FusionConfig, ctx) -> Result:
    fn, inputs = model(config.model, config.rows, config.width)
    gm = capture(fn, inputs, config.backward)
    # The captured graph on real tensors against eager PyTorch (traced again in real mode to execute it).
    real_inputs = [t.clone().requires_grad_() for t in inputs]
    eager_out = fn(*real_inputs)
    eager = [eager_out] + (list(torch.autograd.grad(eager_out, real_inputs, torch.ones_like(eager_out))) if config.backward else [])
    def joint(*args):
        out = fn(*args)
        return (out, *torch.autograd.grad(out, args, torch.ones_like(out))) if config.backward else (out,)
    real_gm = make_fx(joint, decomposition_table=DECOMPOSE)(*[t.clone().requires_grad_() for t in inputs])
    replay = real_gm(*[t.clone().requires_grad_() for t in inputs])
    err = max((a.detach() - b.detach()).abs().max().item() for a, b in zip(replay, eager))
    g = to_networkx(gm)
    log = []
    before = kernel_stats(g, None)
    if config.dce:
        g, entries = dce(g)
        log += entries
    if config.cse:
        g, entries = cse(g)
        log += entries
    group, rejected, entries = fuse(g, config.vertical, config.horizontal)
    log += entries
    after = kernel_stats(g, group)
    quotient = nx.DiGraph()
    quotient.add_nodes_from(set(group.values()))
    for a, b in g.edges:
        if a in group and b in group and group[a] != group[b]:
            quotient.add_edge(group[a], group[b])
    for n, d in g.nodes(data=True):
        shape = "×".join(map(str, d["shape"])) or "scalar"
        d["label"] = f"{n}\n{d['op']} [{shape}]"
        d["fillcolor"] = KIND_COLOR[d["kind"]]
        d["tooltip"] = f"{d['kind']}, {d['bytes']} B"
    clusters = {}
    for n, gid in group.items():
        clusters.setdefault(gid, []).append(n)
    checks = [Check("the captured graph equals eager PyTorch (outputs and gradients)", err, 1e-5,
                    reference="eager PyTorch, fp32", detail="max |difference|"),
              Check("the kernels of the fusion plan form an acyclic graph", 0 if nx.is_directed_acyclic_graph(quotient) else 1, 0,
                    reference="networkx on the quotient graph")]
    return Result(
        metrics={"model": config.model, "backward": config.backward, "kernels_unfused": before["kernels"], "kernels_fused": after["kernels"],
                 "bytes_unfused": before["bytes_moved"], "bytes_fused": after["bytes_moved"], "ideal_unique_bytes": after["ideal_unique_bytes"],
                 "ops": sum(1 for _, d in g.nodes(data=True) if d["kind"] in ("pointwise", "reduction", "opaque"))},
        tables={"log": [{"pass": e.split(":")[0], "what and why": e} for e in log], "why_not": rejected,
                "graph_dot": [{"dot": to_dot_clusters(g, clusters)}]},
        checks=checks,
        notes=["A fusion plan over the captured graph: kernel counts and bytes assume each group becomes one kernel. "
               "Generating and running the Triton kernels is not built yet."])


def to_dot_clusters(g: nx.DiGraph, clusters: dict[int, list[str]]) -> str:
    """DOT with one dashed cluster per fused group of two or more ops."""
    text = to_dot(g, rankdir="TB").rstrip().rstrip("}")
    for gid, nodes in clusters.items():
        if len(nodes) > 1:
            text += f'  subgraph cluster_{gid} {{ label="kernel {gid}"; style=dashed; ' + " ".join(f'"{n}";' for n in nodes) + " }\n"
    return text + "}"


register("graph.fusion", FusionConfig,
         "capture forward+backward as an aten DAG; DCE, CSE, vertical and horizontal fusion with why-not reasons; kernels and bytes",
         run_fn=run)
