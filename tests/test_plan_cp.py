"""Llama 3's all-gather context parallelism and attention at a published kernel's speed, at the 131k row's shapes.

Each check counts from the tensors' own shapes (meta tensors: numel and element size, no memory) or from the FlashAttention-3
paper's printed speeds, not from the planner's functions; each has a test that breaks the rule and sees it fail."""
import dataclasses

import pytest
import torch

from backend.config import ConfigError
from backend.plan import costs
from backend.plan import compute as C
from backend.plan import models as M
from backend.plan import predict, published
from backend.plan.clusters import GPUS, Cluster

SPEC = M.load("llama-3.1-405b")
ROW = next(r for r in published.ROWS if r.name == published.CP131K)
PLAN = ROW.plan                                   # TP 8, CP 16, PP 16, v 8, seq 131,072, micro-batch 1, all-gather CP
CLUSTER = Cluster(GPUS[ROW.gpu], ROW.nodes)


def _local_kv(plan=PLAN, seq=None):
    """This rank's K and V: b × tokens × the KV heads it holds under TP (GQA: 8 over t = 8, one each) × head dim, bf16."""
    heads = -(-SPEC.kv_heads // plan.tp)
    shape = (plan.micro_batch, seq or plan.seq_len // plan.cp, heads, SPEC.head_dim)
    return [torch.empty(shape, dtype=torch.bfloat16, device="meta") for _ in range(2)]


def _allgather_sent_by_shapes(cp: int) -> int:
    """Bytes rank 0 sends: a ring all-gather of every rank's K and V blocks (it forwards cp − 1 blocks of each), then a
    ring reduce-scatter of the full-length dK and dV (cp − 1 chunks of each, one per step)."""
    blocks = [_local_kv() for _ in range(cp)]
    sent = sum(t.numel() * t.element_size() for step in range(cp - 1) for t in blocks[(0 - step) % cp])
    grads = _local_kv(seq=PLAN.seq_len)
    chunks = [g.chunk(cp, dim=1) for g in grads]
    sent += sum(c[(0 - step - 1) % cp].numel() * c[0].element_size() for step in range(cp - 1) for c in chunks)
    return sent


def _allgather_mismatch() -> float:
    return costs.cp_sent_bytes("allgather", predict.kv_numel(SPEC, PLAN), PLAN.cp) - _allgather_sent_by_shapes(PLAN.cp)


def test_allgather_cp_bytes_equal_the_count_from_the_tensor_shapes():
    assert _allgather_mismatch() == 0
    ring = 3 * (PLAN.cp - 1) * sum(t.numel() * t.element_size() for t in _local_kv())
    assert costs.cp_sent_bytes("ring", predict.kv_numel(SPEC, PLAN), PLAN.cp) == ring


def test_allgather_bytes_check_fails_for_ring_attentions_rule(monkeypatch):
    monkeypatch.setattr(costs, "cp_sent_bytes", lambda comm, n, cp, item=2, regather=False: 3 * (cp - 1) * n * item)
    assert _allgather_mismatch() != 0


def _gathered_in_memory() -> float:
    """Activation bytes the all-gather plan holds beyond the same plan on ring attention, per live chunk-micro-batch."""
    dp = predict.validate(SPEC, CLUSTER, PLAN)
    ag = predict.memory(SPEC, CLUSTER, PLAN, dp)["_stages"]["first"]
    ring = predict.memory(SPEC, CLUSTER, dataclasses.replace(PLAN, cp_comm="ring"), dp)["_stages"]["first"]
    layers = predict.stage_layers(SPEC, PLAN) / PLAN.vp
    return (ag["activations (layers)"] - ring["activations (layers)"]) / (ag["_live"] * layers)


def test_allgather_cp_holds_every_positions_k_and_v_for_the_backward():
    full = sum(t.numel() * t.element_size() for t in _local_kv(seq=PLAN.seq_len))   # 64 MiB a layer at 131k
    assert _gathered_in_memory() == full == 64 * 2 ** 20


def test_gathered_kv_check_fails_when_the_memory_rule_drops_them(monkeypatch):
    monkeypatch.setattr(costs, "cp_gathered_bytes", lambda *a, **k: 0.0)
    assert _gathered_in_memory() == 0


def _zigzag_pairs(rank: int, cp: int, seq: int) -> int:
    """Query-key pairs a causal mask keeps for the two chunks rank `rank` holds (chunks r and 2cp − 1 − r of 2cp)."""
    n = seq // (2 * cp)
    return sum(pos + 1 for c in (rank, 2 * cp - 1 - rank) for pos in range(c * n, (c + 1) * n))


def _attention_seconds_by_paper():
    """FlashAttention-3 on an H100 SXM (Shah et al. 2024, Figs. 5 and 6, head dim 128, 16k): 648 TFLOP/s forward, 561
    backward, the backward doing 2.5× the forward's FLOPs; 4·d FLOPs a pair forward, the rank's heads (128 / t)."""
    pairs = _zigzag_pairs(3, PLAN.cp, PLAN.seq_len)
    assert pairs == _zigzag_pairs(0, PLAN.cp, PLAN.seq_len)          # the zigzag balances the ranks exactly
    fwd_flops = 4 * SPEC.head_dim * (SPEC.heads // PLAN.tp) * pairs * predict.stage_layers(SPEC, PLAN) / PLAN.vp
    return fwd_flops / 648e12, 2.5 * fwd_flops / 561e12


def test_hopper_attention_runs_at_the_published_kernel_speed():
    eff = published.fit()
    chunk = predict.chunk_compute(SPEC, CLUSTER, PLAN, eff)
    f, b = _attention_seconds_by_paper()
    assert chunk.f_att == pytest.approx(f, rel=1e-9) and chunk.b_att == pytest.approx(b, rel=1e-9)


def test_attention_speed_check_fails_when_the_backward_does_the_model_count(monkeypatch):
    monkeypatch.setattr(C, "FA_BACKWARD_FLOPS", 2.0)
    chunk = predict.chunk_compute(SPEC, CLUSTER, PLAN, published.fit())
    assert chunk.b_att != pytest.approx(_attention_seconds_by_paper()[1], rel=1e-3)


def test_a_hopper_kernel_on_an_a100_is_refused_by_name():
    a100 = Cluster(GPUS["A100 80GB SXM"], 8)
    with pytest.raises(ConfigError) as err:
        predict.validate(M.load("llama-3-8b"), a100, predict.Plan(tp=1, global_batch=64, attention_kernel="fa3"))
    assert err.value.field == "attention_kernel" and "allowed: fa2" in str(err.value)


def test_the_131k_row_under_each_published_kernel():
    """The paper does not name its attention kernel: with FlashAttention-3 (the rows' choice) or cuDNN the row lands
    within 10%, with FlashAttention-2 (PyTorch SDPA's default) it misses below; the table's FA3 entry is the row."""
    table = {r["attention kernel"]: r for r in published.cp131k_by_attention_kernel()}
    row = {r["row"]: r for r in published.errors()}[published.CP131K]
    assert table["fa3"]["predicted"] == pytest.approx(row["predicted"], rel=1e-9)
    assert table["fa3"]["within"] and table["cudnn"]["within"] and table["fa2"]["error"] < -0.10


def _stored_before_the_kernel_table() -> tuple[dict, object]:
    """A plan.training result as version 1 stored it: no kernel table, no HBM2e column in the 500 W account."""
    from backend import experiments
    r = experiments.run("plan.training")
    tables = {k: [dict(row) for row in v] for k, v in r.tables.items() if k != "cp131k_by_attention_kernel"}
    for row in tables["hopper_500w"]:
        row.pop("HBM2e cost (modelled: throughput at 2.4 ÷ at 3.35 TB/s)")
    return {"metrics": dict(r.metrics), "tables": tables}, experiments.get("plan.training").schema


def test_a_run_stored_before_the_kernel_table_is_upgraded():
    stored, schema = _stored_before_the_kernel_table()
    assert [p for p in schema.problems(stored["metrics"], stored["tables"]) if "missing" in p]
    upgraded = schema.upgrade(stored)
    assert not [p for p in schema.problems(upgraded["metrics"], upgraded["tables"]) if "missing" in p]
    assert upgraded["tables"]["cp131k_by_attention_kernel"] == []


def _exposed_cp_mismatch(plan=PLAN) -> float:
    """The step's exposed CP seconds against the bytes from the tensor shapes over the network link (the planner's
    bus efficiency and α per ring step), all of it on the critical path: m · v chunk-micro-batches, each with its
    forward all-gather and backward reduce-scatter, 2(cp − 1) ring steps."""
    eff = published.fit()
    dp = predict.validate(SPEC, CLUSTER, plan)
    st = predict.step(SPEC, CLUSTER, plan, dp, eff)
    per_chunk = (_allgather_sent_by_shapes(plan.cp) / (CLUSTER.net * predict.BUS_EFFICIENCY)
                 + 2 * (plan.cp - 1) * predict.LATENCY["network"]) * predict.stage_layers(SPEC, plan) / plan.vp
    return st["exposed_s"]["cp"] - st["m"] * plan.vp * per_chunk


def test_the_all_gather_sits_on_the_critical_path_and_ring_attention_hides():
    assert _exposed_cp_mismatch() == pytest.approx(0, abs=1e-9)
    dp = predict.validate(SPEC, CLUSTER, PLAN)
    ring = predict.step(SPEC, CLUSTER, dataclasses.replace(PLAN, cp_comm="ring"), dp, published.fit())
    assert ring["exposed_s"]["cp"] == 0      # at 131k each block's attention outlasts its transfer


def test_exposure_check_fails_when_the_gather_is_hidden_like_ring_attention(monkeypatch):
    monkeypatch.setattr(predict, "cp_exposed", lambda comm, comm_s, attention_s: max(0.0, comm_s - attention_s))
    assert _exposed_cp_mismatch() < -0.1


def test_full_recompute_gathers_k_and_v_again():
    numel = predict.kv_numel(SPEC, PLAN)
    once = sum(t.numel() * t.element_size() for step in range(PLAN.cp - 1) for t in _local_kv())   # one more all-gather
    assert costs.cp_sent_bytes("allgather", numel, PLAN.cp, regather=True) == _allgather_sent_by_shapes(PLAN.cp) + once
    assert costs.cp_gathered_bytes("allgather", numel, PLAN.cp, "full") == 0
