"""Mesh checkpoints for every plan (backend/checkpoint/mesh_state.MeshState through parallel.mesh's settings): FSDP2's
DTensor state saved with DCP, a killed rank resumed bit for bit and the checkpoint continued on dp 2 and under ZeRO-1
(and ZeRO-3's under FSDP2) equal to one float64 process; every precision's master weights, Adam states and fp16's loss
scaler restored bit for bit; async_save's checkpoints equal the sync save's bit for bit; each rank's file holding
exactly its share of the model. Each check is shown to fail when its rule is broken."""
import pytest
import torch

from backend import experiments
from backend.comm.spawn import spawn_ranks
from backend.config import ConfigError
from backend.experiments import RunContext
from backend.checkpoint import checkpointer as ckpt
from backend.checkpoint import mesh_state
from backend.checkpoint import pieces as dcp_pieces

EXP = experiments.get("parallel.mesh")
BITWISE = "final parameters equal the uninterrupted run's bit for bit"
KILLED = "the killed rank died by SIGKILL, its process is gone, and every rank restarted"
TOTAL = "tensor bytes in the last checkpoint equal the model's state exactly (each piece written once)"
PER_RANK = "each rank's checkpoint file holds exactly its share: its weights, Adam m, v and the rest"
RESHARDED = "resharded ({}): final parameters equal one process"
FSDP2 = {"world_size": "4", "tp": "1", "pp": "1", "microbatches": "1", "dp_strategy": "fsdp2", "steps": "4",
         "checkpoint_every": "2"}
# pp 2 x dp 2 with ZeRO-1, fp16 from S = 2^21: step 0 overflows and is skipped (S halves) before the first checkpoint,
# so a resume that restarted the scaler at 2^21 would overflow again (tests/test_mesh_precision.py's FP16 plan)
FP16 = {"world_size": "4", "tp": "1", "pp": "2", "schedule": "1f1b", "dp_strategy": "zero1", "precision": "fp16_mixed",
        "init_loss_scale": str(2 ** 21), "steps": "5", "batch": "8", "seq": "16", "checkpoint_every": "2",
        "kill_rank": "1", "kill_step": "3"}


def _checks(result) -> dict:
    return {c.name: c for c in result.checks}


def _failing(result) -> list[str]:
    return [f"{c.name}: {c.error}" for c in result.checks if not c.passed]


def _spawned(rank_fn, settings: dict, tmp_path, restarts: int = 0):
    """The mesh run's ranks through `rank_fn` (a rule broken in them), combined as the experiment does."""
    config = EXP.make_config(settings)
    payloads = spawn_ranks(rank_fn, config.world_size, config, RunContext(scratch_dir=str(tmp_path), timeout_s=600),
                           restarts=restarts)
    return EXP.combine(config, payloads)


@pytest.mark.timeout(900)
def test_fsdp2_is_killed_resumed_bit_for_bit_and_continued_on_dp2():
    """FSDP2 over dp 4: rank 1 killed in step 3, every rank restarted from step 2's checkpoint (the DTensors' local rows
    and Adam's m, v of them), bit for bit; the checkpoint continued on pp 2 x dp 2 under FSDP2 equals one process."""
    result = EXP.run(EXP.make_config({**FSDP2, "kill_rank": "1", "kill_step": "3", "reshard_tp": "1", "reshard_pp": "2"}))
    checks = _checks(result)
    assert result.passed, _failing(result)
    for name in (BITWISE, KILLED, TOTAL, PER_RANK, RESHARDED.format("tp 1 x pp 1 x dp 4 fsdp2 -> tp 1 x pp 2 x dp 2 fsdp2")):
        assert checks[name].passed and checks[name].error <= 1e-9, name
    assert checks[BITWISE].error == 0 and (result.metrics["attempts"], result.metrics["resumed_from_step"]) == (2, 2)


@pytest.mark.timeout(900)
@pytest.mark.parametrize("plan, strategy", [(FSDP2, "zero1"), ({**FSDP2, "dp_strategy": "zero3"}, "fsdp2")],
                         ids=["fsdp2-to-zero1", "zero3-to-fsdp2"])
def test_a_checkpoint_continues_under_another_dp_strategy_equal_to_one_process(plan, strategy):
    """Both keyed by the one model's tensors at their global offsets: FSDP2's rows read into ZeRO's flat cuts, and
    back, by DCP's load plan."""
    result = EXP.run(EXP.make_config({**plan, "reshard_tp": "1", "reshard_pp": "2", "reshard_strategy": strategy}))
    name = RESHARDED.format(f"tp 1 x pp 1 x dp 4 {plan['dp_strategy']} -> tp 1 x pp 2 x dp 2 {strategy}")
    assert result.passed and _checks(result)[name].error < 1e-9, _failing(result)


def _next_ranks_rows(rank, world, config, ctx):
    """The rule broken: each FSDP2 rank saves (and loads) its rows at the next dp rank's offset."""
    from backend.experiments.parallel import mesh

    right = mesh_state.dtensor_offset

    def shifted(shard):
        offset = right(shard)
        return ((offset[0] + shard.to_local().shape[0]) % shard.shape[0],) + offset[1:]
    mesh_state.dtensor_offset = shifted
    return mesh.run_rank(rank, world, config, ctx)


@pytest.mark.timeout(900)
def test_the_continuation_differs_when_fsdp2_rows_are_saved_at_another_ranks_offset(tmp_path):
    result = _spawned(_next_ranks_rows, {**FSDP2, "reshard_tp": "1", "reshard_pp": "2"}, tmp_path)
    name = RESHARDED.format("tp 1 x pp 1 x dp 4 fsdp2 -> tp 1 x pp 2 x dp 2 fsdp2")
    assert not _checks(result)[name].passed and _checks(result)[TOTAL].passed


@pytest.mark.timeout(900)
@pytest.mark.parametrize("settings", [
    FP16,
    {"world_size": "4", "tp": "1", "pp": "2", "dp_strategy": "zero3", "precision": "bf16_mixed", "steps": "4",
     "checkpoint_every": "2", "kill_rank": "2", "kill_step": "3"},
    {"world_size": "4", "tp": "2", "pp": "2", "precision": "fp32", "steps": "3", "checkpoint_every": "1", "kill_rank": "3",
     "kill_step": "2"},
], ids=["fp16-zero1", "bf16-zero3", "fp32-tp2xpp2"])
def test_every_precision_is_killed_and_resumed_bit_for_bit(settings):
    """The master copy (fp32) and Adam's m, v are what is saved, the compute copy cast from it after the load; fp16 also
    its loss scaler (S, clean steps, each step's S and skip), so the resumed run skips what the uninterrupted run did."""
    result = EXP.run(EXP.make_config(settings))
    checks = _checks(result)
    assert result.passed, _failing(result)
    assert checks[BITWISE].error == 0 and checks[PER_RANK].passed and checks[TOTAL].passed
    if settings is FP16:
        assert result.metrics["resumed_from_step"] == 2
        assert "skipped steps [0];" in checks["every rank's loss scale and skipped steps equal torch.amp.GradScaler's"].detail


def _scaler_not_restored(rank, world, config, ctx):
    """The rule broken: the loss scaler restarts at init_loss_scale after the load (its state not restored)."""
    from backend.experiments.parallel import mesh

    restore = mesh_state.MeshState.load_checkpoint_state

    def without_scaler(self, state):
        restore(self, state)
        self.scaler.scaler.scale, self.scaler.scaler.clean_steps = float(config.init_loss_scale), 0
    mesh_state.MeshState.load_checkpoint_state = without_scaler
    return mesh.run_rank(rank, world, config, ctx)


@pytest.mark.timeout(900)
def test_the_fp16_resume_differs_when_the_loss_scale_is_not_restored(tmp_path):
    result = _spawned(_scaler_not_restored, FP16, tmp_path, restarts=1)
    assert not _checks(result)[BITWISE].passed


def _tp_rank_1_writes(rank, world, config, ctx):
    """The rule broken: a piece both tp ranks hold (a replicated norm) is written by the higher one. The checkpoint
    still holds every byte once, but rank 1's file holds rank 0's share."""
    from backend.experiments.parallel import mesh

    right = mesh_state.MeshState._tp_writer

    def higher(self, shapes, tp_group):
        return {piece: not w if piece[1] is None else w for piece, w in right(self, shapes, tp_group).items()}
    mesh_state.MeshState._tp_writer = higher
    return mesh.run_rank(rank, world, config, ctx)


TP2 = {"world_size": "2", "tp": "2", "pp": "1", "steps": "3", "checkpoint_every": "1"}


@pytest.mark.timeout(900)
def test_the_per_rank_check_fails_when_one_ranks_share_is_wrong(tmp_path):
    result = _spawned(_tp_rank_1_writes, TP2, tmp_path)
    checks = _checks(result)
    assert checks[TOTAL].passed and not checks[PER_RANK].passed
    rows = result.tables["checkpoint_bytes_per_rank"]
    assert any(r["written_bytes"] != r["expected_bytes"] for r in rows if r["rank"] == 1)


def _tensors(path) -> dict:
    """Every tensor of a DCP checkpoint, whole, read in this one process (DCP's own converter to torch.save)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = path.parent / (path.name + ".pt")
    dcp_to_torch_save(str(path), str(out))
    return torch.load(out, weights_only=False)


def _same_bits(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
                                        for k in a)


def _run_rank(rank, world, config, ctx):
    from backend.experiments.parallel import mesh

    return mesh.run_rank(rank, world, config, ctx)


def _staged_one_ulp_off(rank, world, config, ctx):
    """The rule broken: the copy an async save writes is not the state (one weight moved by one ulp)."""
    from backend.experiments.parallel import mesh

    right = dcp_pieces.staged_copy

    def off(state):
        out = right(state)
        t = next(v for k, value in out.items() if k.startswith("model.") and isinstance(value, dcp_pieces.Pieces)
                 for _, v, writes in value.pieces if writes)
        first = (0,) * t.dim()
        t[first] = torch.nextafter(t[first], torch.tensor(float("inf"), dtype=t.dtype))
        return out
    dcp_pieces.staged_copy = off
    return mesh.run_rank(rank, world, config, ctx)


@pytest.mark.timeout(900)
def test_async_save_writes_the_sync_saves_checkpoints_bit_for_bit(tmp_path):
    """The same plan saved with dcp.save and with dcp.async_save (a staged copy written while the next step runs): the
    same final weights, each kept checkpoint's tensors equal bit for bit, the step times of both measured; a staged
    copy one ulp off is seen."""
    runs = {}
    for mode, rank_fn in (("sync", _run_rank), ("async", _run_rank), ("off", _staged_one_ulp_off)):
        result = _spawned(rank_fn, {**TP2, "checkpoint_save": "sync" if mode == "sync" else "async"}, tmp_path / mode)
        runs[mode] = result
        assert mode == "off" or result.passed, _failing(result)
    step = lambda mode: tmp_path / mode / ckpt.CHECKPOINTS / "step_00003"  # noqa: E731
    assert _same_bits(_tensors(step("sync")), _tensors(step("async")))
    assert not _same_bits(_tensors(step("sync")), _tensors(step("off")))
    for mode in ("sync", "async"):
        m = runs[mode].metrics
        assert m["checkpoint_save"] == mode and m["step_s_with_save"] > 0 and m["save_s_mean"] > 0


@pytest.mark.parametrize("change, field", [
    ({"checkpoint_save": "async"}, "checkpoint_save"),  # nothing saved
    ({"checkpoint_every": "1", "reshard_strategy": "zero1"}, "reshard_strategy"),  # no continuation
    ({"checkpoint_every": "1", "reshard_tp": "2", "reshard_pp": "2", "precision": "bf16_mixed"}, "reshard_tp"),
])
def test_bad_checkpoint_combinations_are_refused_by_name(change, field):
    with pytest.raises(ConfigError) as err:
        EXP.make_config(change)
    assert err.value.field == field and "allowed" in str(err.value)
