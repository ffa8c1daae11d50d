"""What a mesh run with checkpoints checks, and the bytes it is checked against.

    checks, metrics, tables = checks_and_tables(config, payloads, ref, cut)  # parallel.mesh's combine

Each rank's file against its share of the model (every element written once, by the lowest rank holding it), the
checkpoint's tensor bytes against the one-process model's state, the final weights bit for bit against the same
plan run without checkpoints or the kill (attempt 0, first), the killed process gone, and the continuation on another
mesh against one float64 process, with DCP's reads as the resharding map. bench_rows reads bench/checkpoint.py's
measured save and load times for the page."""
from __future__ import annotations

import numpy as np

from backend.checkpoint.mesh_run import mesh_label, resharded
from backend.checkpoint.mesh_state import mesh_category, reference_shapes
from backend.parallel.precision import PRECISIONS
from backend.result import Check


def checks_and_tables(config, payloads, ref, cut) -> tuple[list[Check], dict, dict]:
    """The checkpoint checks, metrics and tables of a mesh run with checkpoint_every > 0."""
    from backend.store import pid_alive

    first = payloads[0]["checkpoint"]
    timeline, files, checks = first["timeline"], first["files"], []
    metrics = dict(attempts=first["attempt"] + 1, checkpoint=first["checkpoint"],
                   checkpoint_tensor_bytes=sum(f["tensor bytes"] for f in files),
                   checkpoint_file_bytes=sum(f["bytes"] for f in files),
                   save_s_mean=float(np.mean([s["seconds"] for s in first["saves"]])) if first["saves"] else None,
                   checkpoint_save=config.checkpoint_save, **step_times(timeline, first["attempt"]))
    byte_checks, per_rank = bytes_checks(config, payloads, ref) if files else ([], [])
    checks += byte_checks
    if config.kill_rank >= 0:
        kills = [e for e in timeline if e["event"] == "kill"]
        bitwise = all(p["checkpoint"]["bitwise"] for p in payloads)
        err = max(p["checkpoint"]["baseline_err"] for p in payloads)
        checks.append(Check("final parameters equal the uninterrupted run's bit for bit",
                            0.0 if bitwise else max(err, 1e-300), 0,
                            reference="the same plan trained without checkpoints or the kill, in the same processes "
                                      "(attempt 0, first)", detail="bits compared as uint64 on every rank"))
        gone = bool(kills) and not pid_alive(kills[0]["pid"])
        checks.append(Check("the killed rank died by SIGKILL, its process is gone, and every rank restarted",
                            0 if gone and first["attempt"] == 1 else 1, 0,
                            reference="timeline: a kill (its pid no longer alive), then attempt 1 from the last "
                                      "checkpoint"))
        metrics.update(killed_rank=config.kill_rank, killed_in_step=config.kill_step, resumed_from_step=first["start"],
                       steps_redone=config.kill_step - first["start"], load_s=first["load_s"])
    tables = {"checkpoint_timeline": [{**e, "t_s": e["t"] - timeline[0]["t"]} for e in timeline] if timeline else [],
              "checkpoint_files": files, "checkpoint_bytes_per_rank": per_rank,
              "checkpoint_share_per_rank": share_per_rank(per_rank)}
    if config.reshard_tp:
        more_checks, more_metrics, more_tables = reshard_result(config, payloads, ref, cut)
        checks += more_checks
        metrics.update(more_metrics)
        tables.update(more_tables)
    return checks, metrics, tables


def bytes_checks(config, payloads, ref) -> tuple[list[Check], list[dict]]:
    """The last checkpoint's tensor bytes against the model's state: in all, and each rank's file by category against
    its share (bytes_per_rank's rows, returned with the checks)."""
    first = payloads[0]["checkpoint"]
    files, checks = first["files"], []
    stored = sum(f["tensor bytes"] for f in files)
    item = PRECISIONS[config.precision].item("master")
    model = 3 * item * sum(v.numel() for v in ref["state"].values()) + rest_bytes(config)
    checks.append(Check("tensor bytes in the last checkpoint equal the model's state exactly (each piece written once)",
                        abs(stored - model), 0,
                        reference=f"the one-process model's state_dict: weights (the {config.precision} master "
                                  f"copy) and Adam m and v ({item} B each a parameter), Adam's step and the loop's "
                                  "step (int64), "
                                  "the losses (8 B a step)" + (", the loss scaler (S, clean steps, each step's S and "
                                                               "skip)" if config.precision == "fp16_mixed" else ""),
                        detail=f"{stored:,} B stored in {len(files)} files, {model:,} B counted"))
    per_rank = bytes_per_rank(config, payloads, first["pieces"])
    checks.append(Check("each rank's checkpoint file holds exactly its share: its weights, Adam m, v and the rest",
                        sum(abs(r["written_bytes"] - r["expected_bytes"]) for r in per_rank), 0,
                        reference="each rank's elements of the model from its parallelize sources, pp stage and dp cut "
                                  "(ZeRO: ⌈ψ/dp⌉ of the flat vector; FSDP2: torch.chunk's rows), each written by the "
                                  "holder of lowest (tp index, rank); the steps and loss scaler by rank 0, the losses "
                                  "by the first last-stage rank",
                        detail="; ".join(f"rank {r}: {sum(x['written_bytes'] for x in per_rank if x['rank'] == r):,} B"
                                         for r in sorted({x['rank'] for x in per_rank}))))
    return checks, per_rank


def reshard_result(config, payloads, ref, cut, new_plan=None) -> tuple[list[Check], dict, dict]:
    """The checks, metrics and tables of the continuation on the other mesh (`new_plan`; resharded(config) unless
    given), from the ranks that ran it: its parameters and every step's loss against one float64 process, each new
    rank's reads against the tensor bytes it loaded into (DCP's load plan must cover exactly what the rank holds),
    and DCP's reads as the resharding map: every read (reshard_map), and the bytes each new rank read from each saved
    rank (reshard_bytes)."""
    new = [p["checkpoint"]["reshard"] for p in payloads if p["checkpoint"].get("reshard")]
    param_err = max(float(np.abs(v - cut(ref["state"], n["sources"])[k].numpy()).max())
                    for n in new for k, v in n["params"].items())
    last = next(n for n in new if n["last_stage"])
    loss_err = max(abs(a - b) for a, b in zip(last["losses"], ref["losses"]))
    plan = f"{mesh_label(config)} -> {mesh_label(new_plan or resharded(config))}"
    reference = "TinyDecoder, float64, torch.optim.Adam, one process, all the steps"
    read = {i: sum(r["bytes"] for r in n["reads"]) for i, n in enumerate(new)}
    checks = [
        Check(f"resharded ({plan}): final parameters equal one process", param_err, 1e-9, reference=reference,
              detail="max |difference|"),
        Check("resharded: every step's loss equals one process", loss_err, 1e-9, reference=reference),
        Check("resharded: each new rank's reads add up to the tensor bytes it holds",
              sum(abs(read[i] - n["held"]) for i, n in enumerate(new)), 0,
              reference="the pieces of the model's tensors (and Adam's m, v) each new rank loaded into",
              detail=", ".join(f"rank {i}: {b:,} B read" for i, b in read.items())),
    ]
    metrics = {"reshard_plan": plan, "reshard_from": new[0]["from"], "reshard_load_s": max(n["load_s"] for n in new)}
    reads, pairs = [r for n in new for r in n["reads"]], {}
    for row in reads:
        pairs[(row["new rank"], row["saved rank"])] = pairs.get((row["new rank"], row["saved rank"]), 0) + row["bytes"]
    return checks, metrics, {"reshard_map": reads, "reshard_bytes": [
        {"new rank": a, "saved rank": b, "bytes": v} for (a, b), v in sorted(pairs.items())]}


def resume_bytes(config, payload: dict) -> int:
    """Bytes a rank sends over dp to load a checkpoint: ZeRO-1/2 all-gather the loaded master shards, cast to the
    compute dtype, into the whole weights (a ring over the flat vector padded to a multiple of dp); the others none
    (ZeRO-3 and FSDP2 gather at each step's start anyway, all-reduce and DDP load whole weights)."""
    from backend.comm.collectives import ring_bytes

    if config.dp_strategy not in ("zero1", "zero2") or config.dp == 1:
        return 0
    shard = -(-payload["flat_numel"] // config.dp)
    return ring_bytes("all_gather", shard, config.dp, PRECISIONS[config.precision].item("compute"))


def rest_bytes(config) -> int:
    """The checkpoint's tensors beside the weights and Adam's m, v: Adam's step and the loop's step (int64), the losses
    (float64 a step), and under fp16 the loss scaler (S and its clean steps, float64; each step's S and skip flag)."""
    return 8 + 8 + 8 * config.steps + (16 + 16 * config.steps if config.precision == "fp16_mixed" else 0)


def held_elements(config, payload: dict, shapes: dict, base: dict) -> np.ndarray:
    """The elements of the one model (numbered ref by ref, `base`: each reference tensor's first number) whose weights
    and Adam states this rank keeps: its parameters as parallelize's sources cut them from the reference tensors (in
    model order), then its dp cut: ZeRO's ⌈ψ/dp⌉ of the flat vector, FSDP2's ⌈rows/dp⌉ rows of each parameter."""
    params = []
    for dim, parts in payload["sources"].values():
        numbered = {ref: base[ref] + np.arange(int(np.prod(shapes[ref]))).reshape(shapes[ref]) for ref, _ in parts}
        if dim is None:
            params.append(numbered[parts[0][0]])
        else:
            params.append(np.concatenate([numbered[ref][(slice(None),) * dim + (sl,)] for ref, sl in parts], axis=dim))
    k, i = config.dp, payload["coords"]["dp"]
    if config.dp_strategy == "fsdp2":
        return np.concatenate([x[i * -(-x.shape[0] // k):(i + 1) * -(-x.shape[0] // k)].ravel() for x in params])
    flat = np.concatenate([x.ravel() for x in params])
    if config.dp_strategy.startswith("zero"):
        shard = -(-flat.size // k)
        flat = flat[i * shard:(i + 1) * shard]
    return flat


def expected_per_rank(config, payloads) -> dict[int, dict[str, int]]:
    """Each rank's bytes in the checkpoint by category, from the settings and each rank's parameters: every element of
    the model written once, by the rank of lowest (tp index, rank) holding it, as its weight and Adam's m and v at the
    master dtype's size; the steps (and fp16's scaler) by rank 0, the losses by the lowest rank on the last stage."""
    shapes = reference_shapes(config)
    base, at = {}, 0
    for ref in sorted(shapes):
        base[ref], at = at, at + int(np.prod(shapes[ref]))
    written, item, out = np.zeros(at, dtype=bool), PRECISIONS[config.precision].item("master"), {}
    for p in sorted(payloads, key=lambda p: (p["coords"]["tp"], p["rank"])):
        ids = held_elements(config, p, shapes, base)
        new = np.unique(ids[~written[ids]])
        written[new] = True
        out[p["rank"]] = {"weights": item * new.size, "Adam m, v": 2 * item * new.size, "the rest": 0}
    out[0]["the rest"] += rest_bytes(config) - 8 * config.steps
    out[min(p["rank"] for p in payloads if p["last_stage"])]["the rest"] += 8 * config.steps
    return out


def bytes_per_rank(config, payloads, pieces: list[dict]) -> list[dict]:
    """Each rank's tensor bytes in the checkpoint's files by category (DCP's metadata: which file, so which rank, holds
    each piece), beside expected_per_rank's, and what the rank held before deduplication."""
    expected = expected_per_rank(config, payloads)
    held = {p["rank"]: p["checkpoint"]["held"] for p in payloads}
    written: dict[tuple[int, str], int] = {}
    for x in pieces:
        at = (x["rank"], mesh_category(x["key"]))
        written[at] = written.get(at, 0) + x["bytes"]
    return [{"rank": r, "category": c, "written_bytes": written.get((r, c), 0), "expected_bytes": e,
             "held_bytes": held[r][c]} for r, cats in sorted(expected.items()) for c, e in cats.items()]


def share_per_rank(per_rank: list[dict]) -> list[dict]:
    """Each rank's whole file against its whole share: bytes_per_rank's categories summed per rank (what the page draws
    as a tick over each rank's stacked bar)."""
    out: dict[int, dict] = {}
    for row in per_rank:
        total = out.setdefault(row["rank"], {"rank": row["rank"], "written_bytes": 0, "expected_bytes": 0})
        total["written_bytes"] += row["written_bytes"]
        total["expected_bytes"] += row["expected_bytes"]
    return [out[r] for r in sorted(out)]


def step_intervals(timeline: list[dict], attempt: int) -> tuple[list[float], list[float]]:
    """The wall time from one step's end to the next (rank 0's timeline, the attempt given), split into the steps that
    began with a save (sync: the whole save; async: its staging and the wait for the previous write) and those that
    did not, in seconds."""
    ends = [e for e in timeline if e.get("attempt") == attempt and e["event"] in ("step", "save")]
    saving, plain = [], []
    for i, (a, b) in enumerate(zip(ends, ends[1:])):
        if a["event"] == "step":
            nxt = next((e for e in ends[i + 1:] if e["event"] == "step"), None)
            if nxt and nxt["step"] == a["step"] + 1:
                (saving if b["event"] == "save" else plain).append(nxt["t"] - a["t"])
    return saving, plain


def step_times(timeline: list[dict], attempt: int) -> dict:
    """step_intervals' medians: with and without a save (None where there is none)."""
    saving, plain = step_intervals(timeline, attempt)
    med = lambda x: float(np.median(x)) if x else None  # noqa: E731
    return {"step_s_with_save": med(saving), "step_s_without_save": med(plain)}


BENCH = "bench/results/checkpoint.json"


def bench_rows(path=None) -> tuple[dict, list[dict]] | None:
    """bench/checkpoint.py's measured figures as read from its JSON (None while it has not been run): where and when
    it ran (machine, load average at the start), and a row per plan and save mode: the save's blocking time (median,
    min-max), the load, the steps after a save and without one (medians), the checkpoint's tensor bytes against the
    model's state and the largest rank's."""
    import json
    from pathlib import Path

    path = Path(path) if path else Path(__file__).resolve().parents[2] / BENCH
    if not path.is_file():
        return None
    data = json.loads(path.read_text())
    about = {"machine": data["device"].get("name"), "when": data["when"],
             "load": data["load_average_1_5_15_min_at_start"][0]}
    r3 = lambda x: None if x is None else round(x, 3)  # noqa: E731
    rows = [{"plan": r["plan"], "save": r["mode"], "blocking (s)": r3(r["save_blocking"].get("median_s")),
             "min-max (s)": f"{r['save_blocking']['min_s']:.3f}-{r['save_blocking']['max_s']:.3f}",
             "load (s)": r3(r["load"]["seconds_slowest_rank"]),
             "step, saving (s)": r3(r["step_after_save"].get("median_s")),
             "step, not (s)": r3(r["step_without_save"].get("median_s")),
             "bytes / model (B)": f"{r['checkpoint_tensor_bytes']:,} / {r['model_state_bytes']:,}",
             "top rank (B)": max(x["written_bytes"] for x in r["per_rank_bytes"])} for r in data["rows"]]
    return about, rows
