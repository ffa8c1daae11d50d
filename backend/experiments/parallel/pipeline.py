"""parallel.pipeline: a pipeline schedule on real gloo ranks; Gantt chart, bubble and live activations measured.

The ranks train through the mesh's one loop (parallel/mesh_train.train_rank: a pipeline-only plan, its model the
uniform Linear+tanh stack of _linear_stack.py, so that stages cost the same), a warm-up step and TIMED_STEPS
timed ones. Measured: every action's start and end on every rank in the last step (aligned clocks); bubble per rank =
1 - busy/makespan, replayed with one core per rank from each action's least CPU time over the timed steps and checked
against the makespan model (parallel/pp/makespan.py, fed with the mean cost per action kind and stage), the closed
forms beside it ((p-1)/(m+p-1), interleaved (p-1)/(v·m+p-1), ZB-H1 (p-1)/(3m+p-1), ...); peak live activations per
rank against the schedule's bound. Checked: each step's loss and the weights after the loop's Adam steps against one
process training the whole model on the whole batch (float64, torch.optim.Adam); each rank's op order against
PyTorch's own schedule code (torch.distributed.pipelining: ScheduleInterleaved1F1B, ScheduleInterleavedZeroBubble,
and the runtime orders of ScheduleZBVZeroBubble and ScheduleDualPipeV) where PyTorch has one, and its GPipe / 1F1B
run as a peer; PipeDream's forward and backward weight versions; recomputation's price (the loop's).
"""
from __future__ import annotations

from collections import defaultdict

import dataclasses
import os
from statistics import median_high
from types import SimpleNamespace

import torch

from backend.config import Config, ConfigError, setting
from backend.limits import cost
from backend.experiments import define
from backend.parallel.mesh_train import train_rank
from backend.experiments.parallel import _recompute as recompute
from backend.experiments.parallel._linear_stack import LinearStack, make_batch, make_stage, stage_layers
from backend.parallel.pp.makespan import makespan
from backend.parallel.pp.schedules import SCHEDULES, is_action
from backend.result import Check, Result, Schema
from backend.trace import replay


@dataclasses.dataclass
class PipelineConfig(Config):
    schedule: str = setting("1f1b", choices=tuple(SCHEDULES), help="pipeline schedule")
    world_size: int = setting(4, min=2, max=8, help="pipeline ranks p (each holds v stages)")
    microbatches: int = setting(8, min=1, max=64, help="micro-batches m per step")
    virtual_stages: int = setting(1, min=1, max=4, help="model chunks per rank v (interleaved_1f1b; zb_v and dualpipe_v hold 2 in a V)")
    layers: int = setting(8, min=1, max=64, help="Linear+tanh layers in the whole model, split evenly over p·v stages")
    hidden: int = setting(512, min=8, max=4096, help="layer width: the compute per action")
    batch: int = setting(128, min=1, max=4096, help="samples per step (split into micro-batches)")
    unequal_stages: bool = setting(False, help="make the last stage twice as deep")
    recompute: bool = setting(False, help="keep only stage inputs; recompute the forward in backward (naive, gpipe, 1f1b)")
    weight_stashing: bool = setting(True, help="pipedream: backward on the weights its forward used")
    vertical_sync: bool = setting(False, help="pipedream: every stage runs a micro-batch on the weight version stage 0 used")
    lr: float = setting(0.05, min=0.0, max=1.0, help="pipedream: SGD learning rate per micro-batch")
    seed: int = setting(0, min=0, max=2**31 - 1, help="weights and data")

    @property
    def plan(self):
        return SCHEDULES[self.schedule]

    @property
    def num_stages(self) -> int:
        return self.world_size * self.plan.chunks(self.virtual_stages)

    cost_drivers = ("batch", "hidden", "layers", "microbatches", "world_size")

    def estimate(self):
        """float64 stages; the reference runs every stage on the whole batch for the loop's steps, and PyTorch's own
        schedule runs two more steps on the same ranks, and the loop a warm-up step and TIMED_STEPS timed ones:
        about eight training steps of 6·batch·params flops, and every micro-batch's activations held at once (GPipe's
        worst case) in each; recomputation adds the loop's price (a step without it and one with it, each twice: timed,
        then FLOP-counted) and a third of a step to each recomputing one."""
        params = self.layers * (self.hidden * self.hidden + self.hidden)
        activations = self.batch * self.hidden * self.layers * 8 * 3
        steps = 2 + 2 * STEPS + self.recompute * (4 + (STEPS + 2) / 3)
        return cost(data_bytes=2 * (params * 8 * 3 + activations),
                    flops=steps * 6 * self.batch * params, moved_bytes=steps * 2 * self.batch * self.hidden * 8 * self.world_size,
                    ops=steps * self.microbatches * self.num_stages * 60, ranks=self.world_size,
                    seconds=2.0)  # the fork server imports torch.distributed.pipelining (6.7 s of CPU at the defaults measured)

    def for_schedule(self, name: str) -> dict:
        """These settings under schedule `name` (side by side): the options that schedule lacks turned off."""
        plan = SCHEDULES[name]
        return dict(dataclasses.asdict(self), schedule=name, virtual_stages=self.virtual_stages if plan.interleaved else 1,
                    recompute=self.recompute and plan.supports_recompute, vertical_sync=self.vertical_sync and plan.asynchronous)

    def check(self) -> None:
        plan, m = self.plan, self.plan.microbatches(self.microbatches)
        if self.virtual_stages > 1 and not plan.interleaved:
            held = " (a V-shaped schedule holds its 2 chunks per rank by construction)" if plan.v_shape else ""
            raise ConfigError("virtual_stages", f"{self.virtual_stages} needs an interleaved schedule "
                                                f"({_names('interleaved')}; allowed with {self.schedule}: 1){held}")
        least = plan.min_microbatches_fn(self.world_size) if plan.min_microbatches_fn else 1
        if self.microbatches < least:
            raise ConfigError("microbatches", f"{self.microbatches}: {plan.title} needs at least as many micro-batches as "
                                              f"its {least} stages (allowed with world_size={self.world_size}: >= {least})")
        if self.layers % self.num_stages:
            raise ConfigError("layers", f"{self.layers} layers do not split evenly over {self.num_stages} stages "
                                        f"(p·v; allowed: a multiple of {self.num_stages})")
        if plan.interleaved:
            if self.microbatches < self.world_size:
                raise ConfigError("microbatches", f"{self.microbatches} is fewer than world_size={self.world_size} "
                                                  f"(allowed with an interleaved schedule: >= {self.world_size})")
            rounds = max(1, self.microbatches // self.world_size)
            if self.microbatches % rounds:
                raise ConfigError("microbatches", f"{self.microbatches} is not a multiple of its {rounds} rounds (m // p); "
                                                  "allowed: a multiple of p, or m with m % (m // p) == 0")
        if self.batch % m:
            raise ConfigError("batch", f"{self.batch} does not split into {m} equal micro-batches (allowed: a multiple of microbatches)")
        if self.vertical_sync and not plan.asynchronous:
            raise ConfigError("vertical_sync", f"vertical sync is for asynchronous schedules, not {self.schedule} "
                                               f"(allowed: true with schedule {_names('asynchronous')}; false otherwise)")
        if self.recompute and not plan.supports_recompute:
            raise ConfigError("recompute", f"recomputation is built for other schedules, not {self.schedule} "
                                           f"(allowed: true with schedule {_names('supports_recompute')}; false otherwise)")


def _names(flag: str) -> str:
    """The schedules that have a flag, for messages."""
    return ", ".join(name for name, s in SCHEDULES.items() if getattr(s, flag))


def stack_reference_training(config) -> SimpleNamespace:
    """One process training every stage on the whole batch (the same seeds, float64) with torch.optim.Adam for the
    loop's STEPS steps: each step's loss, the first step's gradients per stage (what PyTorch's schedule run as a peer
    computes) and the final weights, by the loop's names (stage{s}.{parameter})."""
    stages = [make_stage(s, config.hidden, stage_layers(config, s), config.seed) for s in range(config.num_stages)]
    model, (x, y) = torch.nn.Sequential(*stages), make_batch(config)
    opt, losses, first = torch.optim.Adam(model.parameters(), lr=ADAM_LR), [], []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = ((model(x) - y) ** 2).mean()
        loss.backward()
        first = first or [[prm.grad.clone() for prm in mod.parameters()] for mod in stages]
        opt.step()
        losses.append(loss.item())
    return SimpleNamespace(losses=losses, grads=first, weights={f"stage{s}.{k}": v.detach() for s, mod in enumerate(stages)
                                                                for k, v in mod.named_parameters()})


def torch_order(schedule: str, p: int, m: int, v: int, rank: int) -> list[str] | None:
    """The op order PyTorch's own schedule code computes for this rank (None where PyTorch's order is not
    exposed as data: GPipe and 1F1B run their loops inline). The V-shaped schedules are built whole, on stand-in
    stages, and their runtime order read back (pipeline_order_with_comms, each overlapped F&B pair as the F then
    the B its runtime runs); the others from _calculate_single_rank_operations."""
    import torch.distributed.pipelining.schedules as S

    plan = SCHEDULES[schedule]
    if plan.torch_order is None:
        return None
    cls = getattr(S, plan.torch_order)
    if plan.v_shape:
        stages = [SimpleNamespace(num_stages=2 * p, group_size=p, group_rank=rank, submod=None, stage_index=s)
                  for s in plan.stages_on(rank, p)]
        runtime = cls(stages, n_microbatches=m).pipeline_order_with_comms[rank]
        return [str(a) for action in runtime for a in (action.sub_actions or (action,))
                if a.computation_type.value in ("F", "I", "B", "W")]
    rounds = max(1, m // p)
    fake = SimpleNamespace(n_local_stages=v, pp_group_size=p, _n_microbatches=m, number_of_rounds=rounds,
                           microbatches_per_round=m // rounds)
    return [str(a) for a in cls._calculate_single_rank_operations(fake, rank) if a is not None]


def torch_pipelining_peer(rank: int, p: int, config) -> dict:
    """Run PyTorch's own ScheduleGPipe / Schedule1F1B on the same stage (same seed, same data) on these ranks;
    record the order of its forwards and backwards with module hooks, and its gradients."""
    import torch.distributed as dist
    import torch.distributed.pipelining as pipelining

    module = make_stage(rank, config.hidden, stage_layers(config, rank), config.seed)
    x, y = make_batch(config)
    scale = 1.0 / (config.batch * config.hidden)
    stage = pipelining.PipelineStage(module, rank, p, torch.device("cpu"))
    cls = getattr(pipelining, config.plan.torch_peer)
    schedule = cls(stage, n_microbatches=config.microbatches, scale_grads=False,
                   loss_fn=lambda out, target: ((out - target) ** 2).sum() * scale)

    def step():
        if rank == 0:
            schedule.step(x)
        elif rank == p - 1:
            schedule.step(target=y, losses=[])
        else:
            schedule.step()

    step()  # the first step also infers shapes; record the second
    module.zero_grad(set_to_none=True)
    order = []
    module.register_forward_pre_hook(lambda *_: order.append("F"))
    module.register_full_backward_pre_hook(lambda *_: order.append("B"))
    dist.barrier()
    step()
    return {"order": "".join(order), "grads": [prm.grad.numpy().copy() for prm in module.parameters()]}


def torch_peer_refusal(config) -> str | None:
    """Why PyTorch's schedule cannot run these settings as a peer (None where it can)."""
    if config.plan.torch_peer == "Schedule1F1B" and config.microbatches < config.world_size:
        return (f"PyTorch's Schedule1F1B needs at least as many micro-batches as stages ({config.microbatches} < "
                f"{config.world_size}), so it is not run as a peer here; the gradients are still checked against one process.")
    return None


WARM_UP_STEPS = 1  # left out of the least: the loop's first step pays one-off costs (allocator growth, cold caches)
TIMED_STEPS = 3  # steps timed after the warm-up; an action's cost: its least CPU time over them (mark_least_cpu)
STEPS = WARM_UP_STEPS + TIMED_STEPS
ADAM_LR = 1e-3  # a synchronous schedule's Adam: small beside the weights' 1/√hidden, so no tanh saturates in STEPS steps


def loop_config(config: PipelineConfig) -> SimpleNamespace:
    """These settings as the mesh's training loop reads them (parallel/mesh_train.train_rank, with the Linear+tanh
    stack as its model): a pipeline of world_size ranks and nothing else (dp = cp = ep = tp = 1), float64, STEPS
    steps; recomputation is the loop's full one. `lr`: PipeDream's SGD in the walk, else Adam's after each step."""
    lr = config.lr if config.plan.asynchronous else ADAM_LR
    return SimpleNamespace(**{**dataclasses.asdict(config), "recompute": "full" if config.recompute else "none", "lr": lr},
                           num_stages=config.num_stages, pp=config.world_size, dp=1, cp=1, ep=1, tp=1, sp=False, seq=0,
                           experts=0, precision="fp64", dp_strategy="allreduce", bucket_kb=0, steps=STEPS)


def last_step(step_us: list[tuple], events: list[dict]) -> list[dict]:
    """The rank's actions (F, B, I, W) and its sends and receives in its last step, each action marked with its least
    CPU time over the timed steps (mark_least_cpu: the warm-up step left out)."""
    return mark_least_cpu([e for e in events if e["lane"] in ("recv", "send") or is_action(e)], step_us)


def run_rank_with_peer(rank: int, p: int, config, ctx) -> dict:
    """This rank's run through the mesh's one training loop (parallel/mesh_train.train_rank, the Linear+tanh stack as
    its model): its last step as the page draws it (the actions, each with its least CPU time over the timed steps, and
    the sends and receives), that step's walk (live activations, PipeDream's versions), each step's loss, the trained
    weights and recomputation's price; then PyTorch's order for this rank and its schedule run as a peer."""
    out = train_rank(rank, p, loop_config(config), ctx.progress if rank == 0 else None, model_choice=LinearStack)
    payload = {"rank": rank, "trace": {"rank": rank, "events": last_step(out["step_us"], out["trace"]["events"])},
               "losses": out["losses"], "params": out["params"], "order": out["order"],
               "activation_peak_bytes": out["activation_peak_bytes"], **out["walk"]}
    if "price" in out:  # recompute: the loop's step with it and one without, timed and FLOP-counted
        payload["price"] = out["price"]
    # computed here, where the fork server has imported torch's pipelining (the leader would import it again: 2.6 s)
    payload["torch_order"] = torch_order(config.schedule, p, config.plan.microbatches(config.microbatches),
                                         config.plan.chunks(config.virtual_stages), rank)
    if config.plan.torch_peer and not torch_peer_refusal(config):
        payload["torch_peer"] = torch_pipelining_peer(rank, p, config)
    return payload


# Seed 000 (PipeDream, 问题解析), four machines: micro-batch 5's weight versions, a version being the number of
# backwards a stage has applied. Device 1 runs micro-batch 5's forward on version 1 (after micro-batch 1's backward)
# and, without stashing, its backward on version 4 (after 1-4), with stashing on version 1 again; device 2 runs the
# forward on version 2 (after 1-2), with vertical sync on version 1.
SEED_000_PIPEDREAM = {"world_size": 4, "microbatch": 5, "device1_forward": 1,
                      "device1_backward": {True: 1, False: 4}, "device2_forward": {True: 1, False: 2}}


def pipedream_seed_example(config, versions: list[dict]) -> Check | None:
    """Seed 000's PipeDream example compared with the versions this run recorded (None where the run is not the
    seed's picture: 4 machines, at least 5 micro-batches)."""
    seed = SEED_000_PIPEDREAM
    if config.world_size != seed["world_size"] or config.microbatches < seed["microbatch"]:
        return None
    mb = seed["microbatch"] - 1  # the seed counts micro-batches from 1
    row = {v["stage"]: v for v in versions if v["mb"] == mb}
    figures = [("device 1 forward", row[0]["forward_version"], seed["device1_forward"]),
               ("device 1 backward", row[0].get("backward_version"), seed["device1_backward"][config.weight_stashing]),
               ("device 2 forward", row[1]["forward_version"], seed["device2_forward"][config.vertical_sync])]
    return Check("seed 000's PipeDream example: micro-batch 5's weight versions on devices 1 and 2",
                 sum(ours != theirs for _, ours, theirs in figures), 0,
                 reference=f"seed 000, PipeDream weight stashing and vertical sync (4 machines; stashing "
                           f"{'on' if config.weight_stashing else 'off'}, vertical sync {'on' if config.vertical_sync else 'off'})",
                 detail="; ".join(f"{what}: version {ours} (seed: {theirs})" for what, ours, theirs in figures))


WEIGHTS_TOLERANCE = 1e-12  # float64, micro-batch gradients summed in another order, through Adam (measured ~1e-15)
MIN_TIMED_ACTION_US = 500  # below this, a forward's CPU time is mostly Python overhead and scheduler jitter


def replayed(compute: list[dict], num_stages: int) -> list[dict]:
    """Each rank's actions replayed on a core of its own from the CPU times given (least_costs): F(s, mb) waits for F(s-1, mb)
    (its input activation), a backward of (s, mb) for the backward of (s+1, mb) (its output gradient)."""
    ordered = sorted(compute, key=lambda e: (e["rank"], e["ts"]))
    where, done_on_rank = {}, defaultdict(int)
    for e in ordered:  # each action's key in replay: (rank, its place in the rank's order)
        phase = "F" if e["args"]["kind"] == "F" else ("W" if e["args"]["kind"] == "W" else "B")
        where[(phase, e["args"]["stage"], e["args"]["mb"])] = (e["rank"], done_on_rank[e["rank"]])
        done_on_rank[e["rank"]] += 1

    def depends_on(e):
        kind, s, mb = e["args"]["kind"], e["args"]["stage"], e["args"]["mb"]
        if kind == "F":
            return [where[("F", s - 1, mb)]] if s > 0 else []
        if kind in ("B", "I"):
            return [where[("B", s + 1, mb)]] if s < num_stages - 1 else []
        return []  # W follows its I on the same rank
    return replay(ordered, depends_on)


def mark_least_cpu(events: list[dict], step_us: list[tuple]) -> list[dict]:
    """The events of the last step (`step_us`: (start, end) per step), each action marked `cpu_least_us`: the least
    CPU time of the same (kind, stage, mb) over the steps after the warm-up one (if any). Noise on a shared box only
    adds to CPU time, so the least over repeats is the action's own cost; the warm-up's one-off costs are not."""
    since = (step_us[WARM_UP_STEPS:] or step_us)[0][0]
    least: dict[tuple, float] = {}
    for e in events:
        if is_action(e) and e["ts"] >= since:
            key = (e["args"]["kind"], e["args"]["stage"], e["args"]["mb"])
            least[key] = min(least.get(key, float("inf")), e["cpu_us"])
    drawn = [e for e in events if e["ts"] >= step_us[-1][0]]
    for e in filter(is_action, drawn):
        e["cpu_least_us"] = least[(e["args"]["kind"], e["args"]["stage"], e["args"]["mb"])]
    return drawn


def least_costs(compute: list[dict]) -> list[dict]:
    """The drawn step's actions, each at its least CPU time over the timed steps (`cpu_least_us`: mark_least_cpu): what
    the replay and the makespan model take as its cost. An action preempted mid-way refills its caches on its own
    CPU clock: noise that only adds, so the least over repeats is the action's own cost."""
    return [{**e, "cpu_us": e["cpu_least_us"]} for e in compute]


def median_costs(compute: list[dict]) -> dict[tuple, float]:
    """The median CPU time (µs) of each rank's actions of one kind and stage, over micro-batches: {(rank, kind, stage)}."""
    costs: dict[tuple, list[float]] = {}
    for e in compute:
        costs.setdefault((e["rank"], e["args"]["kind"], e["args"]["stage"]), []).append(e["cpu_us"])
    return {key: median_high(c) for key, c in costs.items()}


def bubbles(compute: list[dict], p: int) -> tuple[float, dict[int, float]]:
    """1 - busy / makespan per rank (makespan from the first action's start to the last action's end, all ranks)."""
    start = min(e["ts"] for e in compute)
    makespan = max(e["ts"] + e["dur"] for e in compute) - start
    per_rank = {r: 1 - sum(e["dur"] for e in compute if e["rank"] == r) / makespan for r in range(p)}
    return makespan, per_rank


def idle_split(events: list[dict], p: int) -> dict[int, dict[str, float]]:
    """Each rank's idle time on the wall clock (makespan - its compute), in µs, split three ways by its blocking recvs
    (each names the stage it receives from): `transfer`, inside a recv after the data's producer (that stage's F, or B/I, of the micro-batch) had
    finished and posted its isend: send/recv latency; `waiting`, inside a recv before that: the neighbour was still
    computing (the schedule's own bubble); `between`, outside any recv or action: posting isends, bookkeeping. With
    actions of a few ms, the transfer part is what the bubble formula, which counts compute only, leaves out."""
    compute = [e for e in events if e["lane"] == "compute"]
    start = min(e["ts"] for e in compute)
    makespan = max(e["ts"] + e["dur"] for e in compute) - start
    done = {(e["args"]["kind"], e["args"]["stage"], e["args"]["mb"]): e["ts"] + e["dur"] for e in compute}
    split = {r: {"idle": makespan - sum(e["dur"] for e in compute if e["rank"] == r), "transfer": 0.0, "waiting": 0.0}
             for r in range(p)}
    for e in events:
        if e["lane"] != "recv":
            continue
        s, mb = e["args"]["stage"], e["args"]["mb"]  # a recv names the stage it receives from
        grad = e["name"].startswith("recv grad")
        ready = done.get(("F", s, mb)) if not grad else done.get(("B", s, mb), done.get(("I", s, mb)))
        t0, t1 = max(e["ts"], start), min(e["ts"] + e["dur"], start + makespan)  # within the makespan
        if t1 <= t0:
            continue
        ready = t0 if ready is None else min(max(ready, t0), t1)
        split[e["rank"]]["waiting"] += ready - t0
        split[e["rank"]]["transfer"] += t1 - ready
    for row in split.values():
        row["between"] = row["idle"] - row["transfer"] - row["waiting"]
    return split


def mean_stage_costs(compute: list[dict]) -> dict[str, dict[int, float]]:
    """The mean CPU time (µs) of each kind of action on each stage over its micro-batches: {kind: {stage: µs}}."""
    runs: dict[tuple, list[float]] = {}
    for e in compute:
        runs.setdefault((e["args"]["kind"], e["args"]["stage"]), []).append(e["cpu_us"])
    out: dict[str, dict[int, float]] = {}
    for (kind, stage), c in runs.items():
        out.setdefault(kind, {})[stage] = sum(c) / len(c)
    return out


def model_against_replay(schedule: str, p: int, m: int, v: int, compute: list[dict]):
    """The makespan model fed with the mean cost per action kind and stage of `compute` (one step's F/B/I/W events,
    ranks numbered 0..p-1 along the pipeline), and the check that it equals the replay of the recorded order at those
    same costs, action by action. Returns (check, the model's Makespan, the mean costs)."""
    stages = p * SCHEDULES[schedule].chunks(v)
    means = mean_stage_costs(compute)
    costs = {kind: [by_stage.get(s, 0.0) for s in range(stages)] for kind, by_stage in means.items()}
    model = makespan(schedule, p, m, v, costs)
    at_means = replayed([{**e, "cpu_us": means[e["args"]["kind"]][e["args"]["stage"]]} for e in compute], stages)
    start_of = {(e["rank"], e["args"]["kind"], e["args"]["stage"], e["args"]["mb"]): e["ts"] for e in at_means}
    apart = max(abs(start_of[(r, a.kind, a.stage, a.mb)] - begin) for r, a, begin, _ in model.timeline)
    exact = Check("makespan model equals the replay of the executed order at the same mean stage costs, action by action",
                  apart / model.step, 1e-9,
                  reference="the recorded per-rank order replayed with one core per rank (backend.trace.replay), each "
                            "action at its stage's mean CPU time",
                  detail=f"largest difference of an action's start {apart:.3g} µs over a step of {model.step / 1e3:.3f} ms "
                         f"(error relative to the step)")
    return exact, model, means


def makespan_checks(config, compute: list[dict], replay_bubble: dict[int, float]) -> tuple[Check, Check, dict, dict]:
    """The makespan model fed with the run's mean cost per action kind and stage (the schedule's order and dependencies,
    walked independently of the replay) against (1) the replay of the executed order at those same costs: equal to
    rounding, or the executor ran another order or the model has a wrong dependency; (2) the replayed idle (mean over ranks) with
    every action at its own least CPU time over the timed steps, within 5 points: what the spread of equal actions'
    costs leaves of the prediction (bench/pipeline.py --repeat). The closed forms
    (equal stages; F-then-B / alternating with measured stages where the schedule has one) are shown beside it."""
    plan, p = config.plan, config.world_size
    v, m = plan.chunks(config.virtual_stages), plan.microbatches(config.microbatches)
    exact, model, means = model_against_replay(config.schedule, p, m, config.virtual_stages, compute)
    replay_mean, model_mean = sum(replay_bubble.values()) / p, sum(model.idle.values()) / p
    gap = abs(replay_mean - model_mean)  # the step's bubble: idle averaged over the ranks (each rank's is drawn)
    worst = max(range(p), key=lambda r: abs(replay_bubble[r] - model.idle[r]))
    metrics = {"bubble_makespan_model_mean": round(sum(model.idle.values()) / p, 4),
               "makespan_model_ms": round(model.step / 1e3, 3)}
    beside = f"textbook {plan.bubble_formula} = {100 * plan.bubble(p, m, v):.1f} %"
    if plan.makespan_fn:  # the closed form generalised to unequal stages, each rank's F and B summed over its stages
        f = [sum(means["F"].get(s, 0.0) for s in plan.stages_on(r, p, v)) for r in range(p)]
        b = [sum(c.get(s, 0.0) for k, c in means.items() if k != "F" for s in plan.stages_on(r, p, v)) for r in range(p)]
        busiest = max(range(p), key=lambda r: f[r] + b[r])
        closed = 1 - m * (f[busiest] + b[busiest]) / plan.makespan_fn(f, b, m)
        metrics["bubble_model_measured_stages"] = round(closed, 4)
        beside += f"; closed form with measured stages {100 * closed:.1f} % (rank {busiest})"
    near = Check("replayed bubble (mean over ranks) within 5 points of the makespan model with measured mean stage costs", gap, 0.05,
                  reference=f"{plan.title}: the order walked with its dependencies (F after the previous stage's F, "
                            "B or I after the next stage's backward, W after I), each action at its stage's mean CPU time; "
                            "the replay takes each action's least CPU time over the timed steps",
                  detail=f"mean over ranks replayed {100 * replay_mean:.1f} %, model {100 * model_mean:.1f} %; the rank furthest "
                         f"apart, {worst}: replayed {100 * replay_bubble[worst]:.1f} %, model {100 * model.idle[worst]:.1f} % "
                         f"(one action's jitter on the fill path moves a single rank); {beside}")
    return exact, near, metrics, model.idle


def measure(config: PipelineConfig, payloads: list[dict]) -> SimpleNamespace:
    """The step's figures from the ranks' traces: wall-clock and replayed (one core per rank) bubbles, the idle split,
    each rank's row, and the busiest stage, which sets the pace."""
    plan, p = config.plan, config.world_size
    v, m = plan.chunks(config.virtual_stages), plan.microbatches(config.microbatches)
    events = [e for pl in payloads for e in pl["trace"]["events"]]
    compute = [e for e in events if e["lane"] == "compute"]
    costed = least_costs(compute)
    makespan, wall_bubble = bubbles(compute, p)
    one_core = replayed(costed, config.num_stages)
    replay_makespan, replay_bubble = bubbles(one_core, p)
    model, idle = plan.bubble(p, m, v), idle_split(events, p)
    per_stage = [stage_row(pl, compute, wall_bubble, replay_bubble, idle, model, plan.live_bound(p, m, pl["rank"], v))
                 for pl in payloads]
    cpu = {row["rank"]: row["cpu_ms"] for row in per_stage}
    bottleneck = max(cpu, key=cpu.get)  # the stage that sets the pace; the others also idle for the imbalance
    return SimpleNamespace(p=p, m=m, v=v, events=events, compute=compute, costed=costed, start=min(e["ts"] for e in compute),
                           makespan=makespan, wall_bubble=wall_bubble, one_core=one_core,
                           replay_makespan=replay_makespan, replay_bubble=replay_bubble, model=model, idle=idle,
                           per_stage=per_stage, bottleneck=bottleneck, pace=replay_bubble[bottleneck],
                           imbalance=(max(cpu.values()) - min(cpu.values())) / max(cpu.values()),
                           mean_bubble=sum(wall_bubble.values()) / p, mean_replayed=sum(replay_bubble.values()) / p)


def stage_row(pl: dict, compute: list[dict], wall_bubble, replay_bubble, idle, model: float, live_bound: int) -> dict:
    """One rank's row of the stages table: busy and CPU time, its bubbles, its idle split and its peak live activations
    beside the schedule's bound."""
    r = pl["rank"]
    return {"rank": r, "busy_ms": sum(e["dur"] for e in compute if e["rank"] == r) / 1e3,
            "cpu_ms": sum(e["cpu_us"] for e in compute if e["rank"] == r) / 1e3,
            "forward_cpu_ms": sum(e["cpu_us"] for e in compute if e["rank"] == r and e["args"]["kind"] == "F") / 1e3,
            "bubble_wall": wall_bubble[r], "bubble_replayed": replay_bubble[r], "bubble_model": model,
            **{f"{part}_ms": idle[r][part] / 1e3 for part in ("idle", "transfer", "waiting", "between")},
            "peak_live": pl["peak_live"], "peak_live_bound": live_bound}


def training_checks(config: PipelineConfig, payloads: list[dict], ref: SimpleNamespace) -> list[Check]:
    """The loop's STEPS steps against one float64 process training the whole model on the whole batch with
    torch.optim.Adam (`ref`, stack_reference_training): each step's loss (summed over the ranks: only the last stage's
    is not zero) and the final weights. The loss also catches a gradient off by a constant factor, which Adam all but cancels."""
    ours = [sum(step) for step in zip(*(pl["losses"] for pl in payloads))]
    worst = max(float(abs(torch.from_numpy(w) - ref.weights[name]).max()) for pl in payloads for name, w in pl["params"].items())
    reference = "single-process PyTorch autograd and torch.optim.Adam, float64"
    return [Check("each step's loss equals one process training the whole model on the whole batch",
                  max(abs(a - b) for a, b in zip(ours, ref.losses)), WEIGHTS_TOLERANCE, reference=reference,
                  detail=" ".join(f"{a:.6g}" for a in ours) + f" (one process: {' '.join(f'{b:.6g}' for b in ref.losses)})"),
            Check(f"weights after {STEPS} Adam steps equal one process training the whole model on the whole batch",
                  worst, WEIGHTS_TOLERANCE, reference=reference,
                  detail=f"max |difference| over every parameter of every stage (Adam's lr {ADAM_LR})")]


def order_checks(config: PipelineConfig, payloads: list[dict], per_stage: list[dict]) -> list[Check]:
    """Peak live activations against the schedule's bound, the loop's losses and weights against one float64 process,
    and each rank's op order against PyTorch's own schedule code and its schedule run as a peer, where PyTorch has them."""
    plan = config.plan
    # (PyTorch's peers are GPipe and 1F1B: synchronous)
    ref = None if plan.asynchronous else stack_reference_training(config)
    checks = [Check("peak live activations per rank equal the schedule's bound", sum(abs(s["peak_live"] - s["peak_live_bound"]) for s in per_stage),
                    0, reference=f"{plan.title}: {plan.live_bound_source}")]
    if not plan.asynchronous:
        checks += training_checks(config, payloads, ref)
    for r in range(config.world_size):
        theirs = payloads[r]["torch_order"]
        if theirs is not None:
            mine = payloads[r]["order"]
            checks.append(Check(f"rank {r}: op order equals torch.distributed.pipelining's", 0 if mine == theirs else 1, 0,
                                reference=f"PyTorch {config.schedule} schedule code", detail=" ".join(mine[:12]) + " …"))
    if all("torch_peer" in pl for pl in payloads):
        ours = ["".join(a[len(str(pl["rank"]))] for a in pl["order"]) for pl in payloads]
        theirs = [pl["torch_peer"]["order"] for pl in payloads]
        checks.append(Check(f"op order (F/B per rank) equals torch.distributed.pipelining's {plan.torch_peer} run as a peer",
                            sum(a != b for a, b in zip(ours, theirs)), 0, reference="PyTorch's schedule on the same model, recorded by module hooks",
                            detail=" | ".join(theirs)))
        worst = max((torch.from_numpy(g) - rg).abs().max().item()
                    for pl in payloads for g, rg in zip(pl["torch_peer"]["grads"], ref.grads[pl["rank"]]))
        checks.append(Check("the PyTorch peer's gradients equal the single-process reference too", worst, 1e-12,
                            reference="single-process PyTorch autograd, float64"))
    return checks


def pipedream_checks(config: PipelineConfig, versions: list[dict], errors: list[dict]) -> tuple[list[Check], list[str]]:
    """PipeDream's weight versions: with stashing every backward uses its forward's version, with vertical sync every
    stage runs a micro-batch on one version, and seed 000's example; what is switched off is described instead."""
    checks, notes = [], []
    mismatched = sum(1 for v_ in versions if v_["forward_version"] != v_.get("backward_version"))
    if config.weight_stashing:
        checks.append(Check("weight stashing: every backward used its forward's weight version", mismatched, 0,
                            reference="the versions recorded at F and B"))
    else:
        notes.append(f"Without stashing, {mismatched} of {len(versions)} micro-batch backwards ran on newer weights than "
                     f"their forward; mean relative gradient error {sum(e['relative_error'] for e in errors) / max(1, len(errors)):.3g}.")
        checks.append(Check("without stashing, some backward sees other weights than its forward", 0 if mismatched else 1, 0,
                            reference="seed 000: the inconsistency PipeDream's stashing removes"))
    by_mb = {}
    for v_ in versions:
        by_mb.setdefault(v_["mb"], set()).add(v_["forward_version"])
    spread = sum(len(vs) > 1 for vs in by_mb.values())
    if config.vertical_sync:
        checks.append(Check("vertical sync: every stage ran each micro-batch on the same weight version", spread, 0,
                            reference="stage 0's version at the micro-batch's forward"))
    else:
        notes.append(f"Without vertical sync, {spread} of {len(by_mb)} micro-batches ran on different weight versions "
                     "on different stages.")
    seed_check = pipedream_seed_example(config, versions)
    if seed_check:
        checks.append(seed_check)
    else:
        notes.append("Seed 000's PipeDream example (micro-batch 5's weight versions) is drawn for 4 machines and at "
                     "least 5 micro-batches: set world_size 4 and microbatches ≥ 5 to have it checked.")
    return checks, notes


def step_metrics(config: PipelineConfig, fig: SimpleNamespace) -> dict:
    """The step's headline figures: makespans, bubbles (wall, replayed at the busiest stage and on average, textbook),
    stage imbalance, the mean action and the share of idle time spent in transfers."""
    plan, idle, events = config.plan, fig.idle, fig.events
    return {"schedule": config.schedule, "bubble_formula": plan.bubble_formula, "p": fig.p, "m": fig.m, "v": fig.v,
            "makespan_ms": round(fig.makespan / 1e3, 3),
            "makespan_replayed_ms": round(fig.replay_makespan / 1e3, 3),
            "bubble_measured": round(fig.mean_bubble, 4), "bubble_replayed": round(fig.pace, 4),
            "bubble_replayed_mean": round(fig.mean_replayed, 4), "bubble_model": round(fig.model, 4),
            "bubble_gap_pp": round(100 * (fig.pace - fig.model), 2), "stage_imbalance": round(fig.imbalance, 4),
            "mean_action_cpu_ms": round(sum(e["cpu_us"] for e in fig.compute) / len(fig.compute) / 1e3, 3),
            "idle_transfer_share": round(sum(i["transfer"] for i in idle.values()) / max(1e-9, sum(i["idle"] for i in idle.values())), 4),
            "recv_transfer_ms": round(sum(i["transfer"] for i in idle.values()) / 1e3 / max(1, sum(e["lane"] == "recv" for e in events)), 4)}


def published_idle(config: PipelineConfig, fig: SimpleNamespace) -> tuple[dict, list[str]]:
    """The published table's idle formula (DualPipe-V) fed with this run's median chunk costs, beside the replay."""
    plan = config.plan
    if not plan.published_idle_fn:
        return {}, []
    median = median_costs(fig.costed)
    kinds = {k: [c for (_, kind, _), c in median.items() if kind == k] for k in ("F", "I", "W", "B")}
    per = {k: sum(kinds[k]) / len(kinds[k]) for k in ("F", "W")}  # every chunk runs some I and W, and all its F
    per["I"] = sum(kinds["I"]) / len(kinds["I"]) if kinds["I"] else sum(kinds["B"]) / len(kinds["B"]) - per["W"]
    idle = plan.published_idle_fn(fig.p, per["F"], per["I"], per["W"])
    bubble = round(idle / (idle + 2 * fig.m * sum(per.values())), 4)
    note = (f"{plan.published_idle_formula}, with this run's median chunk costs (F {per['F'] / 1e3:.2f}, "
            f"I {per['I'] / 1e3:.2f}, W {per['W'] / 1e3:.2f} ms): {100 * bubble:.1f} % "
            f"idle, beside {100 * fig.pace:.1f} % replayed. The table's figure assumes the F&B pair overlapped; "
            f"run one after the other, this order idles p − 1 chunk-forwards per rank when F = I = W.")
    return {"bubble_published_measured_costs": bubble, "published_idle_formula": plan.published_idle_formula}, [note]


def bubble_notes(config: PipelineConfig, fig: SimpleNamespace) -> list[str]:
    """Why the wall-clock bubble differs from the replayed one (ranks sharing cores) and from the formula (unequal stages)."""
    notes, cores = [], os.cpu_count() or 1
    if cores < fig.p:
        notes.append(f"{fig.p} ranks share this machine's {cores} cores, so the wall-clock timeline shows their contention "
                     f"(bubble {100 * fig.mean_bubble:.1f} % on the wall clock). The replay gives every rank a core of its own and each "
                     f"action its least CPU time over the timed steps: the busiest stage (rank {fig.bottleneck}) idles {100 * fig.pace:.1f} %, against "
                     f"{100 * fig.model:.1f} % from {config.plan.bubble_formula}.")
    notes.append(f"Stages differ in cost by {100 * fig.imbalance:.0f} % (the last computes the loss, the first no input gradient), "
                 f"so the lighter stages also wait for the busiest: {100 * fig.mean_replayed:.1f} % idle on average in the replay.")
    return notes


def timed_check(config: PipelineConfig, compute: list[dict], near: Check) -> tuple[list[Check], list[str]]:
    """The replayed bubble against the makespan model is checked only where actions are long enough to time and the
    schedule flushes; otherwise it is shown, with the reason."""
    forward = sum(e["cpu_us"] for e in compute if e["args"]["kind"] == "F") / sum(e["args"]["kind"] == "F" for e in compute)
    if forward < MIN_TIMED_ACTION_US:
        return [], [f"Forwards average {forward:.0f} µs of CPU, too short to time against the clock's jitter, so "
                    f"the replayed bubble's distance from the makespan model ({100 * near.error:.1f} points) is shown but not "
                    f"checked (a larger hidden size makes each action longer)."]
    if config.plan.asynchronous:
        return [], [f"PipeDream's backward carries its weight update and stash copy, whose CPU time varies several-fold "
                    f"from one micro-batch to the next here, and it has no flush (this step's bubble is one batch's picture): "
                    f"the replayed bubble is {100 * near.error:.1f} points from the makespan model, shown, not checked."]
    return [near], []


def gantt_rows(fig: SimpleNamespace, payloads: list[dict]) -> tuple[list[dict], list[dict]]:
    """The Gantt table (every recorded event, then the one-core replay, in ms from the step's start) and live activations."""
    start = fig.start
    gantt = [{"rank": e["rank"], "lane": e["lane"], "name": e["name"], "kind": e["args"].get("kind", e["lane"]),
              "mb": e["args"].get("mb"), "stage": e["args"].get("stage"),
              "start_ms": (e["ts"] - start) / 1e3, "end_ms": (e["ts"] + e["dur"] - start) / 1e3} for e in fig.events]
    gantt += [{"rank": e["rank"], "lane": "replayed", "name": e["name"], "kind": e["args"]["kind"], "mb": e["args"]["mb"],
               "stage": e["args"]["stage"], "start_ms": e["ts"] / 1e3, "end_ms": (e["ts"] + e["dur"]) / 1e3} for e in fig.one_core]
    live = [{"rank": pl["rank"], "t_ms": (t["t_us"] - start) / 1e3, "live": t["live"]} for pl in payloads for t in pl["timeline"]]
    return gantt, live


def combine(config: PipelineConfig, payloads: list[dict]) -> Result:
    """measure -> check -> describe: the step's figures, its checks (order, gradients, weight versions, the makespan
    model), then the metrics, notes and tables the page draws."""
    fig = measure(config, payloads)
    checks = order_checks(config, payloads, fig.per_stage)
    notes = [torch_peer_refusal(config)] if torch_peer_refusal(config) else []
    versions = [dict(v_, rank=pl["rank"]) for pl in payloads for v_ in pl["versions"]]
    errors = [e for pl in payloads for e in pl["grad_errors"]]
    if config.plan.asynchronous:
        more_checks, more_notes = pipedream_checks(config, versions, errors)
        checks, notes = checks + more_checks, notes + more_notes
    metrics = step_metrics(config, fig)
    published, published_notes = published_idle(config, fig)
    metrics.update(published)
    notes += bubble_notes(config, fig) + published_notes
    exact, near, model_metrics, model_idle = makespan_checks(config, fig.costed, fig.replay_bubble)
    metrics.update(model_metrics, bubble_makespan_model=round(model_idle[fig.bottleneck], 4))
    for row in fig.per_stage:
        row["bubble_makespan_model"] = model_idle[row["rank"]]
    timed, timed_notes = timed_check(config, fig.costed, near)
    checks, notes = checks + [exact] + timed, notes + timed_notes  # exact: the same costs on both sides, no jitter
    price = []
    if config.recompute:
        more_checks, more_metrics, price, more_notes = recompute.price(config, payloads, stage_layers)
        checks, notes = checks + more_checks, notes + more_notes
        metrics.update(more_metrics)
    gantt, live = gantt_rows(fig, payloads)
    return Result(metrics=metrics, checks=checks, notes=notes,
                  tables={"gantt": gantt, "stages": fig.per_stage, "live": live, "versions": versions, "grad_errors": errors,
                          "recompute": price, "side_by_side": side_by_side(config)},
                  trace_events=fig.events)


def side_by_side(config: PipelineConfig) -> list[dict]:
    """This run's settings under each other schedule (for_schedule: the options it lacks turned off), one row each:
    what the page submits to run the same plan beside this one."""
    return [config.for_schedule(name) for name in SCHEDULES if name != config.schedule]


IDLE_SPLIT = ("transfer_ms", "waiting_ms", "between_ms")  # each rank's wall-clock idle split (a column of `stages`)


def _v1_unsplit_idle_and_no_comparison(result: dict) -> None:
    """Version 1 -> 2: runs stored before the idle split, the makespan model or the side-by-side settings lack them;
    None (an empty table) says the run did not measure them, and the page says so."""
    metrics, tables = result["metrics"], result["tables"]
    for key in ("recv_transfer_ms", "idle_transfer_share", "bubble_makespan_model", "makespan_model_ms"):
        metrics.setdefault(key, None)
    for row in tables.get("stages", []):
        for key in IDLE_SPLIT:
            row.setdefault(key, None)
    tables.setdefault("side_by_side", [])
    tables.setdefault("recompute", [])


RECOMPUTE = ("recompute_flops_overhead", "recompute_textbook_overhead", "recompute_time_model", "recompute_time_overhead",
             "recompute_to_forward_time", "recompute_cpu_ms", "activation_peak_saved_bytes")  # recompute = true
RESULT = Schema(
    metrics=("schedule", "p", "m", "v", "bubble_formula", "bubble_model", "bubble_measured", "bubble_replayed",
             "bubble_replayed_mean", "bubble_gap_pp", "stage_imbalance", "makespan_ms", "makespan_replayed_ms",
             "mean_action_cpu_ms", "recv_transfer_ms", "idle_transfer_share", "bubble_makespan_model",
             "bubble_makespan_model_mean", "makespan_model_ms",
             "bubble_model_measured_stages",  # schedules with a closed form (naive, GPipe, 1F1B)
             "bubble_published_measured_costs", "published_idle_formula",  # schedules with a published idle formula
             *RECOMPUTE),
    tables={"gantt": ("rank", "lane", "name", "kind", "mb", "stage", "start_ms", "end_ms"),
            "stages": ("rank", "busy_ms", "cpu_ms", "forward_cpu_ms", "idle_ms", *IDLE_SPLIT, "bubble_wall", "bubble_replayed",
                       "bubble_model", "bubble_makespan_model", "peak_live", "peak_live_bound"),
            "live": ("rank", "t_ms", "live"),
            "versions": ("rank", "stage", "mb", "forward_version", "backward_version"),  # PipeDream only, else empty
            "grad_errors": ("stage", "mb", "relative_error"),  # PipeDream only, else empty
            "recompute": ("rank", "stage", "forwards", "forwards_without", "forward_flops_per_microbatch", "extra_forward_flops",
                          "compute_cpu_ms", "compute_cpu_without_ms", "forward_cpu_without_ms", "recompute_cpu_ms",
                          "median_forward_cpu_without_ms", "median_recompute_cpu_ms", "peak_activation_bytes",
                          "peak_model_bytes", "peak_without_bytes", "peak_without_model_bytes", "saved_bytes"),  # recompute only
            "side_by_side": tuple(f.name for f in PipelineConfig.fields())},  # every other schedule's settings
    optional=("bubble_model_measured_stages", "bubble_published_measured_costs", "published_idle_formula", *RECOMPUTE),
    version=2, upgrades={1: _v1_unsplit_idle_and_no_comparison},
)

EXPERIMENT = define(__name__, PipelineConfig,
         "pipeline schedules (naive, GPipe, 1F1B, interleaved, ZB-H1, ZB-V, DualPipe-V, PipeDream) on gloo ranks: Gantt, bubble, activations",
         rank_fn=run_rank_with_peer, combine=combine, lanes=("compute", "recv", "send"),
         preload=("torch.distributed.pipelining",), schema=RESULT)
