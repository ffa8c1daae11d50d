"""Placement across ranks: the pass's decisions on known cases, and runs on gloo equal to one process."""
from backend import experiments
from backend.graph import ir
from backend.graph.placement import place, transfers
from backend.experiments.graph.placement import PlacementConfig, graph_and_plan


def test_two_branches_go_to_two_ranks_and_meet_on_rank_0():
    g, _, rank_of, _, plan, _ = graph_and_plan(PlacementConfig())
    mms = sorted((n for n in g if ir.get(g, n).op == "mm"), key=lambda n: int(n.split("_")[1]) if "_" in n else 0)
    assert {rank_of[n] for n in mms} == {0, 1}                 # one branch each (seed 002's two servers)
    cat = next(n for n in g if ir.get(g, n).op == "cat")
    assert rank_of[cat] == 0                                   # results gathered on one server
    assert all(t["value"] in g.graph["inputs"] or t["dst"] == 0 for t in plan)


def test_a_slow_link_keeps_everything_on_one_rank():
    g, *_ = graph_and_plan(PlacementConfig())
    rank_of, _, _ = place(g, 2, flops_per_s=1e12, link_bytes_per_s=1e3, latency_s=1.0)
    assert set(rank_of.values()) == {0} and transfers(g, rank_of) == []


def test_two_branch_on_gloo_equals_one_process():
    result = experiments.run("graph.placement")
    assert result.passed, [c for c in result.checks if not c.passed]
    assert result.metrics["transfers"] == 4 and min(result.metrics["ops_per_rank"]) > 0


def test_joint_forward_backward_on_three_ranks_equals_one_process():
    result = experiments.run("graph.placement", model="block", backward=True, world_size=3, rows=16, width=32,
                             gflops=0.05, latency_us=1.0)
    assert result.passed, [c for c in result.checks if not c.passed]
    assert result.metrics["transfers"] > 0
