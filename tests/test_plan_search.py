"""The planner's rank order and its search over every choice the one-plan model has (K/V exchange, rank order; the
attention kernel the user's). Links are checked against the ranks laid out on a grid (numpy) or the live mesh's own
groups (mesh.DeviceMesh.lines), the search's shortcuts against a brute-force enumeration with predict's functions;
each check has a twin that breaks the rule and sees it fail."""
import dataclasses

import numpy as np
import pytest

from backend import experiments
from backend.config import ConfigError
from backend.plan import costs
from backend.parallel.mesh import DIMS, DeviceMesh
from backend.plan import models as M
from backend.plan import predict, search
from backend.plan.clusters import GPUS, Cluster
from backend.plan.predict import ORDERS, RECOMPUTE, Efficiency, Plan

EFF = Efficiency()
H100 = GPUS["H100 SXM 80GB"]
LLAMA_8B = M.load("llama-3-8b")
MEGATRON, LLAMA3 = tuple(ORDERS)


def _crosses_by_grid(plan: Plan, gpus: int, gpus_per_node: int) -> dict[str, bool]:
    """Whether any group of each dimension spans two nodes: ranks 0..gpus−1 laid out row-major on a grid of the plan's
    order (outermost first), a group a line along one axis, a node gpus_per_node consecutive ranks."""
    dims = plan.order.split("-")
    size = {"tp": plan.tp, "cp": plan.cp, "pp": plan.pp, "dp": gpus // (plan.tp * plan.cp * plan.pp)}
    grid = np.arange(gpus).reshape([size[d] for d in dims])
    out = {}
    for axis, d in enumerate(dims):
        lines = np.moveaxis(grid, axis, -1).reshape(-1, size[d])
        out[d] = bool(any(len(set(line // gpus_per_node)) > 1 for line in lines))
    return out


def _link_mismatches(plan: Plan, nodes: int) -> list[str]:
    cluster = Cluster(H100, nodes)
    links = predict.evaluate(LLAMA_8B, cluster, plan, EFF)["time"]["links"]
    grid = _crosses_by_grid(plan, cluster.gpus, cluster.gpus_per_node)
    return [d for d in grid if (links[d] == "network") != grid[d]]


TP4_PP2 = Plan(tp=4, pp=2, dp_strategy="fsdp", micro_batch=1, global_batch=8, seq_len=4096)   # 16 GPUs: dp 2


def test_the_order_decides_which_link_pp_and_dp_cross():
    """tp 4 × pp 2 × dp 2 on two 8-GPU nodes: with dp inside pp the pipeline crosses the node and dp stays on NVLink;
    with Llama 3's pp inside dp, the reverse."""
    cl = Cluster(H100, 2)
    megatron = predict.evaluate(LLAMA_8B, cl, TP4_PP2, EFF)["time"]["links"]
    llama3 = predict.evaluate(LLAMA_8B, cl, dataclasses.replace(TP4_PP2, order=LLAMA3), EFF)["time"]["links"]
    assert (megatron["pp"], megatron["dp"]) == ("network", "nvlink")
    assert (llama3["pp"], llama3["dp"]) == ("nvlink", "network")
    assert megatron["tp"] == llama3["tp"] == "nvlink"


@pytest.mark.parametrize("order", list(ORDERS))
@pytest.mark.parametrize("tp,cp,pp,nodes", [(4, 1, 2, 2), (2, 2, 2, 4), (1, 2, 4, 2), (2, 1, 2, 1), (8, 1, 2, 4)])
def test_every_link_matches_the_ranks_on_a_grid(order, tp, cp, pp, nodes):
    plan = Plan(tp=tp, cp=cp, pp=pp, order=order, dp_strategy="fsdp", micro_batch=1, global_batch=64, seq_len=4096)
    assert _link_mismatches(plan, nodes) == []


def test_the_link_check_fails_when_the_order_is_ignored(monkeypatch):
    """The old rule (ranks always numbered dp inside pp) puts the Llama 3 order's pipeline on the wrong link."""
    real = predict.strides
    monkeypatch.setattr(predict, "strides", lambda plan, gpus: real(dataclasses.replace(plan, order=MEGATRON), gpus))
    assert _link_mismatches(dataclasses.replace(TP4_PP2, order=LLAMA3), 2) == ["dp", "pp"]


def test_the_default_order_is_the_live_mesh_order():
    """The plan's default numbers ranks as parallel.mesh does: every group of mesh.DeviceMesh.lines spans a node exactly
    when the planner says its dimension crosses."""
    assert MEGATRON == "-".join(d for d in DIMS if d != "ep")
    for tp, cp, pp, nodes in [(4, 1, 2, 2), (2, 2, 2, 4), (1, 1, 4, 2)]:
        plan = Plan(tp=tp, cp=cp, pp=pp, dp_strategy="fsdp", micro_batch=1, global_batch=64, seq_len=4096)
        cl = Cluster(H100, nodes)
        shape = DeviceMesh.layout(cl.gpus, tp=tp, cp=cp, pp=pp, dp=cl.gpus // (tp * cp * pp))
        links = predict.evaluate(LLAMA_8B, cl, plan, EFF)["time"]["links"]
        for d in ("tp", "cp", "dp", "pp"):
            spans = any(len({r // cl.gpus_per_node for r in line}) > 1 for line in DeviceMesh.lines(shape, d))
            assert spans == (links[d] == "network"), (tp, cp, pp, nodes, d)


def test_an_unknown_order_is_refused_by_name():
    with pytest.raises(ConfigError, match="^order"):
        predict.validate(LLAMA_8B, Cluster(H100, 2), dataclasses.replace(TP4_PP2, order="tp-pp-dp-cp"))
    with pytest.raises(ConfigError, match="^order.*cannot be run live"):
        experiments.run("plan.training", order=LLAMA3, live_check=True, pp=2, dp_strategy="fsdp")


# --- the search -------------------------------------------------------------------------------------------------

SMALL = (LLAMA_8B, Cluster(H100, 2), 16, 8192)   # 16 GPUs, 16 sequences of 8k: every dimension has room


def _brute_force(model, cluster, global_batch, seq_len, kernel="fa2") -> dict[Plan, float]:
    """Every candidate at the lightest recompute that fits, with its tokens/s per GPU, from predict's functions
    directly: no memory reused across orders, every recompute tried for every plan."""
    out = {}
    for base in search.candidates(model, cluster, global_batch, seq_len, kernel):
        try:
            dp = predict.validate(model, cluster, base)
        except ConfigError:
            continue
        for rec in RECOMPUTE:
            plan = dataclasses.replace(base, recompute=rec)
            if predict.total_bytes(predict.memory(model, cluster, plan, dp, EFF)) <= cluster.gpu.hbm_bytes:
                out[plan] = predict.evaluate(model, cluster, plan, EFF)["tokens_per_s_per_gpu"]
                break
    return out


def _search_mismatch(args=SMALL) -> int:
    found = {r["plan"]: r["tokens_per_s_per_gpu"] for r in search.search(*args, EFF)["ranked"]}
    want = _brute_force(*args)
    return len(set(found) ^ set(want)) + sum(found[p] != pytest.approx(want[p]) for p in set(found) & set(want))


def test_the_search_covers_both_kv_exchanges_and_orders_and_loses_no_plan():
    found = search.search(*SMALL, EFF)
    plans = [r["plan"] for r in found["ranked"]] + [x["plan"] for x in found["infeasible"]]
    shapes = {}
    for p in plans:
        shapes.setdefault((p.tp, p.cp, p.pp, p.vp, p.schedule, p.dp_strategy, p.micro_batch, p.order), set()).add(p.cp_comm)
    assert all(comms == ({"ring", "allgather"} if key[1] > 1 else {"ring"}) for key, comms in shapes.items())
    assert {p.order for p in plans if p.pp > 1 and p.tp * p.cp < 8} == set(ORDERS)
    assert {p.order for p in plans if p.tp * p.cp >= 8} == {MEGATRON}   # tp·cp fills the node: the order moves nothing
    assert {p.attention_kernel for p in plans} == {"fa2"}
    assert _search_mismatch() == 0


def test_the_search_check_fails_when_all_gather_holds_less_than_ring(monkeypatch):
    """The shortcut starts an all-gather plan at its ring twin's recompute; were the gathered K/V negative, it would
    miss all-gather plans that fit with less recompute."""
    monkeypatch.setattr(costs, "cp_gathered_bytes", lambda comm, n, cp, rec, item=2: -40e9 if comm == "allgather" and cp > 1 else 0.0)
    assert _search_mismatch() > 0


def test_the_search_check_fails_when_the_order_moves_bytes(monkeypatch):
    """The shortcut reuses the first order's memory for the second; were the order to change the bytes, it would not."""
    real = predict.memory

    def memory(model, cluster, plan, dp, eff=EFF):
        mem = real(model, cluster, plan, dp, eff)
        return {**mem, "weights": mem["weights"] + (80e9 if plan.order == LLAMA3 and plan.recompute == "none" else 0.0)}
    monkeypatch.setattr(predict, "memory", memory)
    monkeypatch.setattr(search, "memory", memory)
    assert _search_mismatch() > 0


def test_the_kernel_is_the_users_and_refused_by_name_where_the_gpu_lacks_it():
    fa3 = search.search(*SMALL, EFF, kernel="fa3")["ranked"]
    fa2 = search.search(*SMALL, EFF)["ranked"]
    assert {r["plan"].attention_kernel for r in fa3} == {"fa3"}
    assert fa3[0]["tokens_per_s_per_gpu"] > fa2[0]["tokens_per_s_per_gpu"]
    with pytest.raises(ConfigError, match="^attention_kernel.*A100"):
        experiments.run("plan.search", gpu="A100 80GB SXM", attention_kernel="fa3", nodes=1)


def _allgather_row() -> dict:
    """The best-ranked all-gather plan's row of the default search (Llama 3 8B on 64 H100s, 256 × 8k tokens)."""
    r = experiments.run("plan.search", model="llama-3-8b", nodes=8, global_batch=256, seq_len=8192, top=200)
    rows = [row for row in r.tables["ranked"][1:] if row["cp_comm"] == "allgather"]
    return rows[0]


def test_the_table_says_when_all_gather_vs_ring_decides():
    row = _allgather_row()
    assert "all-gather vs ring" in row["why_not_best"]
    assert f"sit exposed ({row['exposed_cp_s']:.2f} s a step)" in row["why_not_best"]


def test_the_reason_disappears_when_all_gather_is_hidden_like_ring(monkeypatch):
    monkeypatch.setattr(predict, "cp_exposed", lambda comm, comm_s, attention_s: max(0.0, comm_s - attention_s))
    assert "all-gather vs ring" not in _allgather_row()["why_not_best"]


def test_ring_losing_to_all_gather_is_told_so():
    """At 2k tokens over cp 8 across nodes, ring attention's 3(cp − 1) passes outlast the short attention; the
    all-gather sends 2(cp − 1) blocks."""
    cl = Cluster(H100, 8)
    plan = Plan(tp=8, cp=8, dp_strategy="fsdp", micro_batch=1, global_batch=1, seq_len=2048)
    ring = predict.evaluate(LLAMA_8B, cl, plan, EFF) | {"plan": plan}
    ag_plan = dataclasses.replace(plan, cp_comm="allgather")
    ag = predict.evaluate(LLAMA_8B, cl, ag_plan, EFF) | {"plan": ag_plan}
    note = search.choice_decides(ring, search.twins([ag, ring]), ag)
    assert ag["tokens_per_s_per_gpu"] > ring["tokens_per_s_per_gpu"]
    assert note.startswith("all-gather vs ring decides: ring attention's 3(cp−1) K/V passes outlast")


def test_a_search_stored_before_the_choices_is_upgraded():
    r = experiments.run("plan.search", nodes=1, top=5)
    schema = experiments.get("plan.search").schema
    tables = {k: [{c: v for c, v in row.items() if c not in ("cp_comm", "order", "attention_kernel")} for row in rows]
              for k, rows in r.tables.items()}
    upgraded = schema.upgrade({"metrics": dict(r.metrics), "tables": tables})
    assert all({"cp_comm", "order", "attention_kernel"} <= set(row) for row in upgraded["tables"]["ranked"])
