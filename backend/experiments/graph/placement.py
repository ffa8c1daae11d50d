"""graph.placement: split a captured graph across ranks, insert send/recv, run it on gloo, and compare the result
with one process running the whole graph (seed 002's two-server example)."""
from __future__ import annotations

import dataclasses

import numpy as np
import torch
import torch.nn.functional as F

from backend.config import Config, setting
from backend.limits import cost
from backend.experiments import define
from backend.graph import ir
from backend.graph.capture import capture, evaluate, to_networkx
from backend.graph.dot import to_dot
from backend.graph.models import model
from backend.graph.placement import place, run_rank as execute, transfers
from backend.result import Check, Result, Schema
from backend.trace import Tracer

RANK_COLOR = ["#dbe8fb", "#fde3d9", "#e2f0d9", "#f3e5f5"]


@dataclasses.dataclass
class PlacementConfig(Config):
    model: str = setting("two_branch", choices=("two_branch", "mlp", "attention", "block"),
                         help="two_branch: two matmul branches of one input, concatenated (seed 002's example)")
    backward: bool = setting(False, help="place the joint forward + backward graph")
    world_size: int = setting(2, min=2, max=4, help="ranks (processes on gloo)")
    rows: int = setting(64, min=1, max=512)
    width: int = setting(256, min=2, max=1024)
    gflops: float = setting(2.0, min=0.001, max=1e6, help="compute rate the placement assumes, GFLOP/s per rank")
    link_gbps: float = setting(1.0, min=0.001, max=1e4, help="link bandwidth the placement assumes, GB/s")
    latency_us: float = setting(50.0, min=0.0, max=1e5, help="per-transfer latency the placement assumes, µs")

    cost_drivers = ("rows", "width", "world_size")

    def estimate(self):
        """A few rows × width × width matmuls per rank, sent between ranks, and a single-process reference."""
        passes = 3 if self.backward else 1
        data = (self.rows * self.width + 4 * self.width * self.width) * 4
        return cost(data_bytes=(self.world_size + 1) * 8 * data, flops=(self.world_size + 1) * passes * 4 * self.rows * self.width ** 2,  # float32 products at ~10x FLOPS
                    moved_bytes=passes * 8 * data, ops=passes * 400, ranks=self.world_size, seconds=0.5)  # 4.7 s of CPU at 512 x 1024 measured


def two_branch(rows: int, width: int):
    g = torch.Generator().manual_seed(0)
    s = width ** -0.5

    def fn(x, w1, w2, w3, w4):
        return torch.cat([F.gelu(x @ w1) @ w2, torch.tanh(x @ w3) @ w4], dim=-1)
    return fn, [torch.randn(rows, width, generator=g)] + [torch.randn(width, width, generator=g) * s for _ in range(4)]


def graph_and_plan(config: PlacementConfig):
    """Deterministic, so every rank and the parent build the same graph, placement and transfer plan."""
    fn, inputs = two_branch(config.rows, config.width) if config.model == "two_branch" else model(config.model, config.rows, config.width)
    g = to_networkx(capture(fn, inputs, config.backward), config.backward)
    if config.backward:
        inputs = inputs + [torch.randn(ir.get(g, g.graph["inputs"][-1]).shape, generator=torch.Generator().manual_seed(1))]
    rank_of, log, modelled = place(g, config.world_size, config.gflops * 1e9, config.link_gbps * 1e9, config.latency_us * 1e-6)
    return g, inputs, rank_of, log, transfers(g, rank_of), modelled


def run_rank(rank: int, world: int, config: PlacementConfig, ctx) -> dict:
    import torch.distributed as dist
    torch.set_num_threads(1)
    g, inputs, rank_of, log, plan, modelled = graph_and_plan(config)
    tracer = Tracer(rank)
    tracer.align(dist.barrier)
    out = execute(g, rank_of, plan, rank, inputs, tracer)
    dist.barrier()
    payload = {"rank": rank, "trace": tracer.payload(), **out}
    if rank == 0:  # the graph's facts, and the one-process reference, from here: the leader never captures (2 s of imports)
        payload["graph"] = graph_facts(g, inputs, rank_of, log, plan, modelled, out["outputs"])
    return payload


def graph_facts(g, inputs, rank_of, log, plan, modelled, gathered) -> dict:
    """What the result shows of the graph: the reference error of the gathered outputs (the same aten graph
    evaluated whole, in one process), the placement log, the transfer plan and the coloured graph."""
    ref = evaluate(g, inputs)
    err = max(float(np.abs(a - ref[o].detach().numpy()).max()) for a, o in zip(gathered, g.graph["outputs"]))
    dot_graph = g.copy()
    for n, node in list(ir.items(dot_graph)):  # graphviz attributes beside the node
        dot_graph.nodes[n].update(label=f"{n}\n{node.op} · rank {rank_of[n]}", fillcolor=RANK_COLOR[rank_of[n] % len(RANK_COLOR)],
                                  tooltip=f"rank {rank_of[n]}, {node.bytes:,} B")
    for a, b, e in dot_graph.edges(data=True):
        if rank_of[a] != rank_of[b]:
            e.update(color="#d62728", style="dashed", label=f"send/recv {ir.get(g, a).bytes:,} B")
    return {"error": err, "rank_of": dict(rank_of), "log": log, "plan": plan, "modelled": modelled,
            "ops": sum(1 for _, node in ir.items(g) if node.kind != "input"), "dot": to_dot(dot_graph, rankdir="TB")}


def combine(config: PlacementConfig, payloads: list[dict]) -> Result:
    facts = payloads[0]["graph"]
    rank_of, plan, err = facts["rank_of"], facts["plan"], facts["error"]
    sent = {t["tag"]: t for pl in payloads for t in pl["log"] if t["event"] == "send"}
    recv = {t["tag"]: t for pl in payloads for t in pl["log"] if t["event"] == "recv"}
    missing = [t["tag"] for t in plan if t["tag"] not in sent or t["tag"] not in recv]
    wrong_rank = [n for pl in payloads for n in pl["computed"] if rank_of[n] != pl["rank"]]
    per_rank = []
    for pl in payloads:
        compute_us = sum(e["dur"] for e in pl["trace"]["events"] if e["lane"] == "compute")
        per_rank.append({"rank": pl["rank"], "ops": len(pl["computed"]), "compute_ms": compute_us / 1e3,
                         "sent_bytes": sum(t["bytes"] for t in plan if t["src"] == pl["rank"]),
                         "received_bytes": sum(t["bytes"] for t in plan if t["dst"] == pl["rank"])})
    end_us = max(e["ts"] + e["dur"] for pl in payloads for e in pl["trace"]["events"])
    checks = [
        Check("outputs gathered on rank 0 equal one process running the whole graph", err, 1e-5,
              reference="the same aten graph evaluated in one process", detail="max |difference|"),
        Check("every planned send/recv happened, on both sides", len(missing), 0, reference="the transfer plan",
              detail=f"missing tags: {missing[:5]}"),
        Check("every rank computed only the ops placed on it", len(wrong_rank), 0, reference="the placement"),
    ]
    return Result(
        metrics={"ranks": config.world_size, "ops": facts["ops"],
                 "transfers": len(plan), "bytes_moved": sum(t["bytes"] for t in plan),
                 "modelled_makespan_ms": facts["modelled"] * 1e3, "measured_makespan_ms": end_us / 1e3,
                 "ops_per_rank": [r["ops"] for r in per_rank]},
        tables={"placement": facts["log"], "transfers": plan, "per_rank": per_rank, "graph_dot": [{"dot": facts["dot"]}],
                "log": [t for pl in payloads for t in pl["log"]]},
        checks=checks, trace_events=[e for pl in payloads for e in pl["trace"]["events"]],
        notes=["Placement uses the modelled rates in the settings; the run measures real time on gloo (CPU processes)."])


RESULT = Schema(
    metrics=(
        "ranks", "ops", "transfers", "bytes_moved", "modelled_makespan_ms", "measured_makespan_ms", "ops_per_rank",
    ),
    tables={
        "placement": ("flops", "node", "op", "rank", "why"),
        "transfers": ("bytes", "dst", "src", "tag", "value"),
        "per_rank": ("compute_ms", "ops", "rank", "received_bytes", "sent_bytes"),
        "graph_dot": ("dot",),
        "log": ("bytes", "event", "peer", "t_us", "tag", "value"),
    },
)

EXPERIMENT = define(__name__, PlacementConfig,
         "split a graph across ranks by earliest finish time, insert send/recv, run on gloo, compare with one process",
         rank_fn=run_rank, combine=combine, lanes=("compute", "send", "recv"),
         preload=("torch._inductor",), schema=RESULT)  # make_fx imports it (2 s) on first capture
