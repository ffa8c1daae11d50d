"""The parallel transforms on the one tiny LLaMA (backend/parallel/parallelize.py), in one process: the batched training
path against the per-sequence generation path, the shards against the head and column layout written out by hand,
the pipeline's stages against the whole model, and the refusals. The runs over real ranks are in test_tensor_parallel,
test_mesh_parallel and test_mesh_presets."""
import dataclasses

import pytest
import torch

from backend.attention import variants
from backend.experiments.parallel.tp import TPConfig
from backend.models.llama import ModelShape, TinyDecoder
from backend.parallel import tp as tp_module
from backend.parallel.cp import SequenceShard
from backend.parallel.parallelize import expected, parallelize, sources
from backend.parallel.tp_model import reference_model, tokens
from backend.parallel.wire import Wire
from backend.trace import Tracer


class Rank:
    """A wire's place in its group without a process group: enough to build a shard (building sends nothing)."""

    def __init__(self, index: int, n: int):
        self.index, self.n = index, n


def _model(**kw) -> tuple[TPConfig, TinyDecoder, torch.Tensor]:
    cfg = TPConfig(**kw).validate()
    return cfg, reference_model(cfg), tokens(cfg)


def _batched_loss(model, batch):
    return model.head_loss(model.run_blocks(model.embed(batch[:, :-1])), batch[:, 1:])[0]


@pytest.mark.parametrize("experts", [0, 4])
def test_the_batched_path_equals_the_per_sequence_reference(experts):
    """run_blocks / head_loss (attention written out, batched) against loss (one sequence at a time through SDPA), float64."""
    torch.manual_seed(0)
    model = TinyDecoder(ModelShape(vocab=32, d_model=16, n_layers=2, n_heads=4, n_kv_heads=2, d_head=4, d_ff=32,
                                   variant="gqa", n_experts=experts)).double()
    batch = torch.randint(0, 32, (3, 9))
    assert abs(_batched_loss(model, batch).item() - model.loss(batch).item()) < 1e-12


def test_a_causal_mask_one_off_fails_the_batched_path(monkeypatch):
    """The check above catches a core that lets each position see the next one."""
    def leaky(self, q, k, v):
        group, s = q.shape[1] // k.shape[1], q.shape[-2]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        mask = torch.full((s, s), float("-inf"), dtype=q.dtype).triu(2)
        return torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5 + mask, dim=-1) @ v
    monkeypatch.setattr(variants.CausalCore, "attend", leaky)
    _, model, batch = _model()
    assert abs(_batched_loss(model, batch).item() - model.loss(batch).item()) > 1e-6


def test_one_rank_equals_one_process_and_the_sources_cover_the_reference():
    cfg, reference, batch = _model()
    ref_loss = reference.loss(batch)
    ref_loss.backward()
    grads = {k: p.grad for k, p in reference.named_parameters()}
    model = parallelize(reference, Wire.alone(0, Tracer(0)))
    loss = _batched_loss(model, batch)
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) < 1e-12
    want = expected(model, grads)
    assert max((p.grad - want[k]).abs().max().item() for k, p in model.named_parameters()) < 1e-12
    assert {ref for _, pieces in sources(model).values() for ref, _ in pieces} == set(grads)


def _heads(w: torch.Tensor, d_head: int, first: int, count: int) -> torch.Tensor:
    """Rows of heads first..first+count-1 of a (heads·d_head, h) projection, by the heads' own layout."""
    return w.view(-1, d_head, w.shape[1])[first:first + count].reshape(-1, w.shape[1])


def _layout_error(reference, cfg, r, n) -> float:
    """Rank r of n's shards against Megatron's layout written out: its query heads with the KV heads of their groups,
    its SwiGLU columns (gate's then up's), the matching rows of down and wo, its vocabulary rows."""
    model = parallelize(reference, Rank(r, n))
    got = dict(model.named_parameters())
    st = reference.state_dict()
    h, kv, f, v = cfg.n_heads // n, cfg.n_kv_heads // n, cfg.d_ff // n, cfg.vocab // n
    p = "blocks.1."
    want = {p + "attn.wqkv.weight": torch.cat([_heads(st[p + "attn.wq.weight"], cfg.d_head, r * h, h),
                                               _heads(st[p + "attn.wk.weight"], cfg.d_head, r * kv, kv),
                                               _heads(st[p + "attn.wv.weight"], cfg.d_head, r * kv, kv)]),
            p + "attn.wo.weight": st[p + "attn.wo.weight"][:, r * h * cfg.d_head:(r + 1) * h * cfg.d_head],
            p + "ffn.w13.weight": torch.cat([st[p + "ffn.gate.weight"][r * f:(r + 1) * f], st[p + "ffn.up.weight"][r * f:(r + 1) * f]]),
            p + "ffn.down.weight": st[p + "ffn.down.weight"][:, r * f:(r + 1) * f],
            "embed.weight": st["embed.weight"][r * v:(r + 1) * v], "head.weight": st["head.weight"][r * v:(r + 1) * v],
            p + "attn_norm.weight": st[p + "attn_norm.weight"]}
    assert set(got) == {k.replace("attn.wq.", "attn.wqkv.").replace("ffn.gate.", "ffn.w13.") for k in st
                        if not any(s in k for s in ("attn.wk.", "attn.wv.", "ffn.up."))}
    assert model.blocks[0].attn.n_heads == h and model.blocks[0].attn.n_kv_heads == kv
    return max((got[k] - w).abs().max().item() for k, w in want.items())


@pytest.mark.parametrize("r, n", [(0, 2), (1, 2), (3, 4)])
def test_shards_follow_the_head_and_column_layout(r, n):
    cfg, reference, _ = _model()
    assert _layout_error(reference, cfg, r, n) == 0


def test_a_neighbours_slice_fails_the_layout(monkeypatch):
    cfg, reference, _ = _model()
    real = tp_module.part
    monkeypatch.setattr(tp_module, "part", lambda total, index, parts: real(total, (index + 1) % parts, parts))
    assert _layout_error(reference, cfg, 0, 2) > 1e-3


def _stages_error(stages: int) -> tuple[float, bool, list]:
    """The stages run one after another against one process's loss, and whether they hold each reference tensor once."""
    cfg, reference, batch = _model(layers=4)
    alone = Wire.alone(0, Tracer(0))
    parts = [parallelize(reference, alone, stage=s, stages=stages) for s in range(stages)]
    x = parts[0].embed(batch[:, :-1])
    for part in parts:
        x = part.run_blocks(x)
    loss = parts[-1].head_loss(x, batch[:, 1:])[0]
    held = [ref for m in parts for _, pieces in sources(m).values() for ref, _ in pieces]
    return abs(loss.item() - reference.loss(batch).item()), sorted(held) == sorted(reference.state_dict()), parts


@pytest.mark.parametrize("stages", [2, 4])
def test_stages_in_turn_equal_the_whole_model(stages):
    """split_stages: each block on exactly one stage, the embedding on the first, the head on the last; the stages
    run one after another give one process's loss."""
    error, once, parts = _stages_error(stages)
    assert error < 1e-12 and once
    assert [m.embed is not None for m in parts] == [True] + [False] * (stages - 1)
    assert [m.head is not None for m in parts] == [False] * (stages - 1) + [True]


def test_overlapping_stages_fail(monkeypatch):
    """A split that gives each stage one block too many runs a block twice and holds it twice."""
    from backend.parallel import parallelize as module
    monkeypatch.setattr(module, "part", lambda total, i, n: slice(i * total // n, min(total, (i + 1) * total // n + 1)))
    error, once, _ = _stages_error(2)
    assert error > 1e-6 and not once


def test_refusals_name_what_is_not_built():
    cfg, reference, _ = _model()
    alone = Wire.alone(0, Tracer(0))
    mla = TinyDecoder(dataclasses.replace(reference.shape, variant="mla")).double()
    with pytest.raises(ValueError, match="multi-head latent attention"):
        parallelize(mla, alone)
    with pytest.raises(ValueError, match="n_kv_heads=1 does not divide by the tensor-parallel degree 2"):
        parallelize(TinyDecoder(dataclasses.replace(reference.shape, variant="mqa")).double(), Rank(0, 2))


def test_sp_beside_moe_and_cp_builds_and_marks_what_its_shard_alone_trains():
    """SP with MoE blocks: the MoE layer (router, experts, shared expert) runs on each tp rank's sequence shard, so its
    weights are summed over tp as the norms' are (tagged sequence_parallel); attention and the head are not. Without SP
    nothing is tagged. SP beside cp builds (the runs are in test_mesh_sp_combo)."""
    cfg, reference, _ = _model()
    alone = Wire.alone(0, Tracer(0))
    moe = TinyDecoder(dataclasses.replace(reference.shape, n_experts=4)).double()
    for sp in (True, False):
        model = parallelize(moe, alone, sp=sp, ep=alone)
        tagged = {k for k, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
        ffn = {k for k in dict(model.named_parameters()) if ".ffn." in k}
        norms = {k for k in dict(model.named_parameters()) if "norm" in k}
        assert tagged == ((ffn | norms) if sp else set()) and ffn and norms
    parallelize(reference, alone, sp=True, cp=SequenceShard(cfg.seq, Wire.alone(0, Tracer(0))))
