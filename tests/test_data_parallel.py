"""The data-parallel family's settings (model=mlp retired: refused by name) and the parameter servers on the tiny
LLaMA: synchronous against one float64 process, asynchronous and bounded-stale against a replay of the server's log,
bytes conserved over the wire; a wrong parameter, a lost byte or a lying log fails."""
import copy

import pytest

from backend.config import ConfigError
from backend.comm.spawn import spawn_ranks
from backend.experiments import RunContext
from backend.experiments.parallel import dp_ps as ps_experiment
from backend.experiments.parallel.ddp import DDPConfig
from backend.experiments.parallel.dp_ps import PSConfig
from backend.experiments.parallel.fsdp import FSDPConfig
from backend.experiments.parallel.zero import ZeroConfig
from tests.sweep import assert_refused


@pytest.mark.parametrize("cls, values, field", [
    (ZeroConfig, {"stage": "4"}, "stage"), (ZeroConfig, {"world_size": "1"}, "world_size"),
    (DDPConfig, {"bucket_kb": "0"}, "bucket_kb"), (FSDPConfig, {"batch": "2", "world_size": "4"}, "batch"),
    (ZeroConfig, {"offload": "true", "stage": "3"}, "offload"), (FSDPConfig, {"hidden": "1024"}, "hidden"),
    (PSConfig, {"server": "rank0", "mode": "async"}, "mode"),
])
def test_bad_inputs(cls, values, field):
    with pytest.raises(ConfigError) as info:
        cls.from_dict(values)
    assert info.value.field == field


@pytest.mark.parametrize("cls", [DDPConfig, ZeroConfig, FSDPConfig, PSConfig])
def test_the_retired_mlp_is_refused_by_name(cls):
    """A link or CLI call with model=mlp gets one message naming the field and the one allowed value."""
    assert_refused(cls, {"model": "mlp"}, "model")
    with pytest.raises(ConfigError, match="tiny_llama"):
        cls.from_dict({"model": "mlp"})


@pytest.mark.parametrize("server, mode", [("rank0", "sync"), ("dedicated", "sync"), ("dedicated", "async"), ("dedicated", "stale")])
def test_parameter_servers_on_the_tiny_llama(server, mode):
    cfg = PSConfig(world_size=3, hidden=8, layers=2, batch=12, steps=4, server=server, mode=mode, staleness=0,
                   straggler_ms=20 if mode != "sync" else 0).validate()  # the default lr: no tuning for the check
    combine = ps_experiment.EXPERIMENT.combine
    payloads = spawn_ranks(ps_experiment.run_rank, 3, cfg, RunContext(timeout_s=120))
    result = combine(cfg, payloads)
    assert result.passed, [(c.name, c.error, c.detail) for c in result.checks if not c.passed]
    assert result.tables["eval"][-1]["loss"] < result.tables["eval"][0]["loss"]  # it trains
    payloads[-1]["sent"] += 8  # a worker's message its server never logged receiving
    assert not combine(cfg, payloads).passed
    payloads[-1]["sent"] -= 8
    wrong = copy.deepcopy(payloads)
    wrong[0]["params"] = wrong[0]["params"] + 1e-6  # the server's weights a step off
    assert not combine(cfg, wrong).passed
    if mode == "async":
        assert max(u["staleness"] for u in result.tables["staleness"]) >= 1
        payloads[0]["updates"][-1]["based_on"] = 0  # a log that lies about which version a gradient used
        assert not combine(cfg, payloads).passed
