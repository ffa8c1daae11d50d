"""Issue #27's "every combination runs or is refused by name", on 4 ranks: a covering array over the mesh's choices
(tp, sp, cp, ep with experts, pp with every schedule and its virtual stages and micro-batches, the dp strategy,
recompute, GQA KV heads) in which every pair of choices of two dimensions appears in a row that runs parallel.mesh
and passes every check. A pair no valid row can hold is refused by MeshConfig.validate naming a field, and each such
refusal rule is listed in REFUSED with why that combination cannot run.

The array is built here by a small deterministic greedy (AETG's idea: take the valid row that covers the most pairs
not yet covered, ties to the cheaper row), and its coverage is asserted by an independent pass over the rows."""
import dataclasses
import functools
import itertools
import multiprocessing

import numpy as np
import pytest

from backend.comm.spawn import spawn_ranks
from backend.config import ConfigError
from backend.experiments import RunContext
from backend.experiments.parallel import mesh
from backend.experiments.parallel.mesh import MeshConfig
from backend.parallel.pp.schedules import SCHEDULES

pytestmark = pytest.mark.serial  # 56 runs of 4 ranks: alone, so the browser walk's runs beside it are not starved

WORLD = 4
DIMENSIONS = {
    "tp": (1, 2), "sp": (False, True), "cp": (1, 2), "ep": (1, 2), "experts": (0, 4), "pp": (1, 2, 4),
    "schedule": tuple(n for n, s in SCHEDULES.items() if not s.asynchronous),
    "virtual_stages": (1, 2), "microbatches": (1, 2, 4),
    "dp_strategy": ("allreduce", "ddp", "zero1", "zero2", "zero3", "fsdp2"), "recompute": ("none", "full", "selective"),
    "n_kv_heads": (8, 2),  # MHA, and GQA with 4 query heads per KV head (8 query heads)
    "precision": ("fp64", "bf16_mixed", "fp16_mixed"),
}
# the tiny LLaMA of tests/test_mesh_parallel.py; seq 8 holds cp 2's 4 zigzag chunks
BASE = dict(world_size=WORLD, seq=8, d_model=16, n_heads=8, d_head=4, d_ff=16, vocab=16, steps=2)

# Why each refusal met over the array is right: the combination cannot run as named.
REFUSED = {
    "ep": "expert parallel shards the MoE experts: with experts = 0 there are none to shard",
    "pp": "tp x pp x cp x ep must divide the ranks: the mesh is their product times dp (4 ranks hold no pp 4 x cp 2)",
    "virtual_stages": "only interleaved 1F1B places several looped chunks per rank (the V schedules hold 2 by their "
                      "shape; the others one)",
    "microbatches": "DualPipe-V's order is built for at least 2p micro-batches (torch's ScheduleDualPipeV refuses fewer)",
    "recompute": "selective recompute drops the attention core's a·s² scores: ring attention (cp > 1) keeps none, and "
                 "recomputing it would send the K/V ring again",
    "precision": "MoE routing on bf16 or fp16 activations flips near-tied experts between the ranks and one process, "
                 "and the routing and expert-byte checks compare the very routing (DeepSeek-V3 routes in fp32 for this); "
                 "FSDP2 in the mesh runs float64 only (its MixedPrecisionPolicy is not wired: not built)",
}


def _config(row: dict) -> MeshConfig:
    """The row's choices on the tiny LLaMA: layers enough for the stages (4, or 8 for 8 stages), a batch giving every
    micro-batch of every dp x ep rank a sequence (8, or 16)."""
    cfg = MeshConfig(**{**BASE, **row})
    dp = WORLD // (cfg.tp * cfg.pp * cfg.cp * cfg.ep) or 1
    cfg.layers = max(4, cfg.num_stages)
    cfg.batch = max(8, dp * cfg.ep * cfg.plan.microbatches(cfg.microbatches))
    return cfg


def _cost(row: dict) -> int:
    cfg = _config(row)
    return cfg.layers * cfg.plan.microbatches(cfg.microbatches) * (3 if cfg.cp > 1 else 1) * (2 if cfg.experts else 1)


def pairs_of(row: dict) -> set:
    """Every pair of (dimension, choice) the row holds live: the thing a covering array must contain. Over dp = 1 the
    dp strategy has nothing to sum or shard (it runs, sending nothing), so its pairs count only where dp > 1; sequence
    parallel's only where tp > 1."""
    dead = {"dp_strategy"} if _config(row).dp == 1 else set()
    dead |= {"sp"} if row["sp"] and row["tp"] == 1 else set()
    live = sorted((k, v) for k, v in row.items() if k not in dead)
    return set(itertools.combinations(live, 2))


def all_pairs() -> set:
    names = sorted(DIMENSIONS)
    return {((a, x), (b, y)) for a, b in itertools.combinations(names, 2) for x in DIMENSIONS[a] for y in DIMENSIONS[b]}


def valid(row: dict) -> bool:
    try:
        _config(row).validate()
        return True
    except ConfigError:
        return False


def could_run(row: dict) -> bool:
    """REFUSED's first two rules, cheap to test first (validate takes 0.1 ms a row, over 435,456 rows): the mesh's
    dimensions divide the ranks, and ep > 1 has experts. Only a speed-up: a pair lost here that validate would accept
    is found by the refusal test below, which asks validate itself of every pair no row holds."""
    return WORLD % (row["tp"] * row["pp"] * row["cp"] * row["ep"]) == 0 and (row["ep"] == 1 or row["experts"] > 0)


@functools.cache
def covering_array() -> tuple[list[dict], set]:
    """Greedy pairwise: among every valid row of the full product, repeatedly take the one covering the most pairs not
    yet covered (ties: the cheaper run, then product order) until every pair some valid row holds is covered.
    Returns the rows and the pairs no valid row holds live (each refused by validate, or a dp strategy over dp = 1)."""
    names = sorted(DIMENSIONS)
    rows = [dict(zip(names, values)) for values in itertools.product(*(DIMENSIONS[n] for n in names))]
    rows = [r for r in rows if could_run(r) and valid(r)]
    index = {p: i for i, p in enumerate(sorted(all_pairs(), key=str))}
    held = [[index[p] for p in sorted(pairs_of(r), key=str)] for r in rows]
    width = max(map(len, held))
    members = np.array([h + [len(index)] * (width - len(h)) for h in held])  # padded with a slot never uncovered
    cost = np.array([_cost(r) for r in rows])
    uncovered = np.zeros(len(index) + 1, dtype=bool)
    uncovered[np.unique(members)] = True
    uncovered[-1] = False
    feasible = {p for p, i in index.items() if uncovered[i]}
    chosen = []
    while uncovered.any():
        gain = uncovered[members].sum(axis=1)
        best = np.flatnonzero(gain == gain.max())
        pick = best[np.argmin(cost[best])]
        chosen.append(rows[pick])
        uncovered[members[pick]] = False
    return chosen, all_pairs() - feasible


def uncovered(rows: list[dict], wanted: set) -> set:
    """The wanted pairs no row holds, counted afresh from the rows (not from the greedy's bookkeeping)."""
    held = set()
    for r in rows:
        held |= pairs_of(r)
    return wanted - held


def test_the_array_covers_every_runnable_pair_and_a_dropped_row_breaks_it():
    ARRAY, INFEASIBLE = covering_array()
    runnable = all_pairs() - INFEASIBLE
    assert uncovered(ARRAY, runnable) == set() and all(valid(r) for r in ARRAY)
    assert 35 <= len(ARRAY) <= 56, len(ARRAY)  # 7 schedules x 5 live dp strategies need 35; the CI cost bound
    assert uncovered(ARRAY[:-1], runnable)  # the greedy's last row was taken for a pair no other row holds
    dims_seen = {(d, r[d]) for r in ARRAY for d in DIMENSIONS}
    assert dims_seen == {(d, v) for d, vs in DIMENSIONS.items() for v in vs}


def test_sequence_parallel_beside_cp_and_moe_is_covered_live():
    """Issue #27: sp beside cp and sp with MoE blocks (and ep) were refused as not built; now every such pair is held
    live (tp > 1) by a row of the array that runs and passes every check."""
    ARRAY, INFEASIBLE = covering_array()
    wanted = {(("cp", 2), ("sp", True)), (("experts", 4), ("sp", True)), (("ep", 2), ("sp", True))}
    assert not wanted & INFEASIBLE and not uncovered(ARRAY, wanted)
    assert any(r["sp"] and r["tp"] == 2 and r["cp"] == 2 for r in ARRAY)
    assert any(r["sp"] and r["tp"] == 2 and r["experts"] for r in ARRAY)


def refusals(pairs) -> dict:
    """For each pair, what validate says of a row holding it (the first choice of every other dimension): the field
    it names and its message, or None where it accepts the row."""
    names, out = sorted(DIMENSIONS), {}
    for (a, x), (b, y) in sorted(pairs, key=str):
        others = [n for n in names if n not in (a, b)]
        row = dict(zip(others, (DIMENSIONS[n][0] for n in others)), **{a: x, b: y})
        try:
            _config(row).validate()
            out[((a, x), (b, y))] = None
        except ConfigError as e:
            out[((a, x), (b, y))] = (e.field, str(e))
    return out


def test_every_pair_no_row_can_hold_is_refused_naming_a_justified_field():
    """Each pair no valid row holds live is either refused by validate with one message naming a field whose rule
    REFUSED justifies and saying what is allowed, or is a dp strategy beside a mesh that leaves dp = 1 (pp 4 on 4
    ranks) or sequence parallel beside tp = 1: accepted, and run as the degenerate case. Each justified rule is met (none is kept for nothing)."""
    found = refusals(covering_array()[1])
    accepted = [dict(p) for p, r in found.items() if r is None]
    assert all("dp_strategy" in p or p.get("sp") is True for p in accepted), accepted
    assert {p["pp"] for p in accepted if "pp" in p} <= {4} and {p["tp"] for p in accepted if "tp" in p} <= {1}
    refused = {p: r for p, r in found.items() if r is not None}
    assert {f for f, _ in refused.values()} == set(REFUSED), {p: f for p, (f, _) in refused.items()}
    assert all("allowed" in message for _, message in refused.values())


def test_a_dropped_refusal_rule_is_caught(monkeypatch):
    """Without validate's virtual_stages rule (1F1B given 2 chunks per rank), the pairs it refused are accepted:
    the refusal test above would fail on them."""
    right = MeshConfig.check

    def lax(self):
        try:
            right(self)
        except ConfigError as e:
            if e.field != "virtual_stages":
                raise
    monkeypatch.setattr(MeshConfig, "check", lax)
    found = refusals({(("schedule", "1f1b"), ("virtual_stages", 2))})
    assert list(found.values()) == [None]


# beside the array: ZB-H1 over pp 2 with 4 micro-batches and full recompute, where a rank holds two I-recomputed graphs
SPLIT_RECOMPUTE = MeshConfig(**dict(BASE, tp=1, pp=2, schedule="zb_h1", microbatches=4, batch=8, layers=4, recompute="full"))
# and sizes tp does not split without SP: an odd sequence and a d_model of 18 over tp 2
UNSPLIT = MeshConfig(**dict(BASE, tp=2, pp=2, seq=7, d_model=18, batch=4, layers=4))


def _all(rank, world, configs, ctx):
    return [mesh.run_rank(rank, world, cfg, ctx) for cfg in configs]


@pytest.fixture(scope="module")
def runs():
    ARRAY = covering_array()[0]
    configs = [_config(r).validate() for r in ARRAY] + [SPLIT_RECOMPUTE.validate(), UNSPLIT.validate()]
    per_rank = spawn_ranks(_all, WORLD, configs, RunContext(timeout_s=900), preload=("torch.distributed.pipelining",))
    assert multiprocessing.active_children() == []
    return [(cfg, [per_rank[r][i] for r in range(WORLD)]) for i, cfg in enumerate(configs)]


def test_every_row_of_the_array_runs_and_passes_every_check(runs):
    assert len(runs) == len(covering_array()[0]) + 2
    failed = []
    for (cfg, payloads), row in zip(runs, covering_array()[0] + [{"extra": "SPLIT_RECOMPUTE"}, {"extra": "UNSPLIT"}]):
        result = mesh.combine(cfg, payloads)
        wrong = [(c.name, c.error) for c in result.checks if not c.passed and "(CPU time" not in c.name]
        if wrong:  # (recompute's CPU-time ratio is a measurement of the machine's load, shown on the page; not the array's)
            failed.append((row, wrong))
        assert result.metrics["final_loss"] < result.tables["loss"][0]["loss"], row  # it trains
    assert not failed, "\n".join(map(str, failed))


def test_recompute_counted_as_one_forward_fails_the_byte_check(runs):
    """Full recompute reruns the forward's tp, cp and ep collectives inside B: a byte model that counted each forward
    once fails on every such row of the array (tp, cp and ep each among them)."""
    rows = [(cfg, payloads) for cfg, payloads in runs if cfg.recompute == "full" and cfg.tp * cfg.cp * cfg.ep > 1]
    assert {d for cfg, _ in rows for d in ("tp", "cp", "ep") if getattr(cfg, d) > 1} == {"tp", "cp", "ep"}
    for cfg, payloads in rows:
        once = dataclasses.replace(cfg, recompute="none")
        model = {p["rank"]: mesh.predicted_bytes(once, p, mesh.expert_rows(once, mesh.reference_training(once)["routing"], p))
                 for p in payloads}
        assert any(model[p["rank"]] != {k: p["bytes"][k] for k in model[p["rank"]]} for p in payloads), cfg


def test_recompute_under_a_split_backward_holds_each_graph_from_i_to_w(runs, monkeypatch):
    """Worked by hand: stage inputs of 1 byte kept from F, each micro-batch's 10 bytes recomputed in I and held to W.
    In F0 F1 I0 I1 W0 W1 both graphs are alive after I1: 20 bytes. A formula that frees each graph at its I (as B
    does) fails the activation check of SPLIT_RECOMPUTE's run."""
    from backend.parallel import mesh_train

    order = [("F", 0, 1), ("F", 1, 1), ("I", 0, 1), ("I", 1, 1), ("W", 0, 1), ("W", 1, 1)]
    assert mesh_train.peak_in_flight(order, {1: {0: 10, 1: 10}}, {1: {0: 1, 1: 1}}) == 20
    rows = runs[-2:-1]  # SPLIT_RECOMPUTE
    assert rows[0][0].recompute == "full" and rows[0][0].schedule == "zb_h1"
    right = mesh_train.peak_in_flight

    def freed_at_i(order, per_action, kept=None):
        return right([("B", mb, st) if k == "I" else (k, mb, st) for k, mb, st in order if k != "W"], per_action, kept)
    assert freed_at_i(order, {1: {0: 10, 1: 10}}, {1: {0: 1, 1: 1}}) == 11
    monkeypatch.setattr(mesh, "peak_in_flight", freed_at_i)
    failed = [c for cfg, payloads in rows for c in mesh.combine(cfg, payloads).checks if c.name.startswith("activations held")
              and not c.passed]
    assert failed


def test_sp_under_a_split_backward_counted_without_ws_rerun_fails(runs):
    """Under SP a split backward's W reruns each gathering linear's backward (re-gather and reduce-scatter again): a
    byte model that takes every backward as whole (the W actions dropped from the order it reads) fails on the
    array's SP rows with a split backward."""
    rows = [(c, p) for c, p in runs if c.sp and c.tp > 1 and any(a[0] == "W" and a[2] > 0 for a in p[0]["order_actions"])]
    assert rows  # (stage 0's W runs its whole backward, I having had no input gradient to take: no rerun there)
    for cfg, payloads in rows:
        routing = mesh.reference_training(cfg)["routing"]
        whole = [dict(p, order_actions=[a for a in p["order_actions"] if a[0] != "W"]) for p in payloads]
        model = {p["rank"]: mesh.predicted_bytes(cfg, p, mesh.expert_rows(cfg, routing, p)) for p in whole}
        assert any(model[p["rank"]]["tp"] != p["bytes"]["tp"] for p in payloads), cfg


def test_sizes_tp_does_not_split_are_not_refused():
    """Without SP the sequence is not split over tp and d_model never is: seq 7 and d_model 18 on tp 2 validate (UNSPLIT,
    run beside the array, passes every check); under SP the sequence must divide."""
    MeshConfig(**dict(BASE, tp=2, pp=2, seq=7, d_model=18)).validate()
    with pytest.raises(ConfigError) as info:
        MeshConfig(**dict(BASE, tp=2, pp=2, seq=7, sp=True)).validate()
    assert info.value.field == "seq" and "allowed" in str(info.value)
