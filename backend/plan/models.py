"""Real models from Hugging Face config.json files: their shapes, parameter counts and FLOPs per token.

A config is read as its own architecture writes it: Llama/Mistral/Mixtral/DeepSeek keys (hidden_size,
num_hidden_layers, ...) or GPT-2 keys (n_embd, n_layer, ...). Shipped configs live in backend/plan/configs/;
an uploaded one is checked (backend/uploads.py's one size cap, JSON, every required field a positive integer) and
stored under its content hash, which a run's `model` setting then names, as uploaded traces are (backend/uploads.py).

Parameter counts (the checks against published totals live in PUBLISHED_PARAMS):
  attention   standard: h·(a + 2·kv)·d + a·d·h (+ 4h biases in GPT); MLA (DeepSeek): q_a h·r_q, q_b r_q·a·(d_nope + d_rope),
              kv_a h·(r_kv + d_rope), kv_b r_kv·a·(d_nope + d_v), o a·d_v·h, and the two low-rank norms
  MLP         SwiGLU 3·h·f; GPT 2·h·4h + 5h biases; MoE: E experts of 3·h·f_e, shared experts, a router h·E
  norms       RMSNorm h each (two per layer, one final); GPT LayerNorm 2h each
"""
from __future__ import annotations

import dataclasses
import functools
import json
import re
from pathlib import Path

from backend import uploads

CONFIG_DIR = Path(__file__).with_name("configs")
HASH = re.compile(r"[0-9a-f]{64}")

# field -> the keys architectures use for it, in order of preference
KEYS = {"hidden": ("hidden_size", "n_embd", "d_model"), "layers": ("num_hidden_layers", "n_layer", "num_layers"),
        "heads": ("num_attention_heads", "n_head"), "vocab": ("vocab_size",)}
OPTIONAL = {"kv_heads": ("num_key_value_heads",), "ffn": ("intermediate_size", "n_inner", "ffn_hidden_size"),
            "head_dim": ("head_dim",), "experts": ("num_local_experts", "n_routed_experts", "num_experts"),
            "top_k": ("num_experts_per_tok",), "moe_ffn": ("moe_intermediate_size",), "shared_experts": ("n_shared_experts",),
            "first_dense": ("first_k_dense_replace",), "q_lora": ("q_lora_rank",), "kv_lora": ("kv_lora_rank",),
            "qk_nope": ("qk_nope_head_dim",), "qk_rope": ("qk_rope_head_dim",), "v_head": ("v_head_dim",)}


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    name: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int
    gpt: bool = False          # GPT-2 style: LayerNorm, GELU MLP, biases, dropout (Korthikanti et al.'s models)
    tied: bool = False
    experts: int = 0
    top_k: int = 0
    moe_ffn: int = 0
    shared_experts: int = 0
    first_dense: int = 0       # the first layers keep a dense MLP (DeepSeek-V3: 3)
    q_lora: int = 0            # MLA ranks (DeepSeek); 0 = standard attention
    kv_lora: int = 0
    qk_nope: int = 0
    qk_rope: int = 0
    v_head: int = 0
    positions: int = 0         # learned position embeddings (GPT); 0 = rotary

    @property
    def mla(self) -> bool:
        return self.kv_lora > 0

    @property
    def moe_layers(self) -> int:
        return self.layers - self.first_dense if self.experts else 0

    @property
    def qk_dim(self) -> int:
        """Width of one head's query/key (the QKᵀ contraction)."""
        return self.qk_nope + self.qk_rope if self.mla else self.head_dim

    @property
    def v_dim(self) -> int:
        return self.v_head if self.mla else self.head_dim

    @property
    def kv_width(self) -> int:
        """Elements of K plus V per token that ring attention passes between context-parallel ranks (MLA: its latent)."""
        return self.kv_lora + self.qk_rope if self.mla else 2 * self.kv_heads * self.head_dim


def _get(raw: dict, keys: tuple[str, ...]):
    for k in keys:
        if k in raw and raw[k] is not None:
            return raw[k]
    return None


def parse_config(raw: dict, name: str = "uploaded") -> ModelSpec:
    """A ModelSpec from a config.json dict; ValueError naming the first missing or invalid field."""
    if not isinstance(raw, dict):
        raise ValueError("config.json must hold one JSON object")
    values = {}
    for field, keys in {**KEYS, **OPTIONAL}.items():
        v = _get(raw, keys)
        if v is None:
            if field in KEYS:
                raise ValueError(f"config.json lacks '{keys[0]}' (the {field}; a positive integer)")
            continue
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
            raise ValueError(f"config.json '{next(k for k in keys if k in raw)}' is {v!r} (allowed: a positive integer)")
        values[field] = v
    h, a = values["hidden"], values["heads"]
    gpt = "n_embd" in raw or raw.get("model_type") in ("gpt2", "gpt3", "megatron-gpt")
    values.setdefault("kv_heads", a)
    values.setdefault("head_dim", h // a)
    values.setdefault("ffn", 4 * h if gpt else None)
    if values["ffn"] is None:
        raise ValueError("config.json lacks 'intermediate_size' (the MLP width; a positive integer)")
    if values["kv_heads"] > a or a % values["kv_heads"]:
        raise ValueError(f"config.json 'num_key_value_heads' is {values['kv_heads']} (allowed: a divisor of num_attention_heads, {a})")
    if values.get("experts") and not values.get("top_k"):
        raise ValueError("config.json lacks 'num_experts_per_tok' (experts per token; a positive integer ≤ the experts)")
    if values.get("top_k", 0) > values.get("experts", 0):
        raise ValueError(f"config.json 'num_experts_per_tok' is {values['top_k']} (allowed: 1 to the {values.get('experts', 0)} experts)")
    if values.get("experts"):
        values.setdefault("moe_ffn", values["ffn"])
    if values.get("kv_lora") and not all(values.get(k) for k in ("qk_nope", "qk_rope", "v_head")):
        raise ValueError("config.json has 'kv_lora_rank' but lacks 'qk_nope_head_dim', 'qk_rope_head_dim' or 'v_head_dim' (positive integers)")
    if values.get("first_dense", 0) >= values["layers"]:
        raise ValueError(f"config.json 'first_k_dense_replace' is {values['first_dense']} (allowed: fewer than the {values['layers']} layers)")
    tied = bool(raw.get("tie_word_embeddings", gpt))
    positions = raw.get("n_positions", 0) if gpt else 0
    return ModelSpec(name=name, gpt=gpt, tied=tied, positions=positions if isinstance(positions, int) else 0, **values)


def parse_bytes(data: bytes, name: str = "uploaded") -> ModelSpec:
    uploads.check_size(data, "config.json")
    try:
        raw = json.loads(data.decode("utf-8-sig"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ValueError(f"config.json is not JSON ({err})") from None
    return parse_config(raw, name)


def uploads_dir(root: Path | None = None) -> Path:
    from backend.store import data_dir
    return Path(root or data_dir()) / "models" / "uploads"


def save_config(data: bytes, root: Path | None = None) -> str:
    """Check an uploaded config.json and store it under its content hash (the run's `model`)."""
    parse_bytes(data)
    return uploads.store(data, uploads_dir(root), ".json")


def shipped() -> tuple[str, ...]:
    return tuple(sorted(p.stem for p in CONFIG_DIR.glob("*.json")))


@functools.lru_cache(maxsize=64)
def load(name: str, root: str | None = None) -> ModelSpec:
    """A shipped config by name, or an uploaded one by hash; ValueError saying what is allowed."""
    if name in shipped():
        return parse_bytes((CONFIG_DIR / f"{name}.json").read_bytes(), name)
    if HASH.fullmatch(name):
        path = uploads_dir(Path(root) if root else None) / f"{name}.json"
        if not path.is_file():
            raise ValueError("no uploaded config.json has this hash on this server; upload it again")
        return parse_bytes(uploads.read_capped(path), f"uploaded {name[:8]}")
    raise ValueError(f"{name[:80]!r} is not a model (allowed: {', '.join(shipped())}, or an uploaded config.json's hash)")


# ---- parameter counts -------------------------------------------------------------------------------------------
def attention_params(m: ModelSpec) -> int:
    h, a = m.hidden, m.heads
    if m.mla:
        q = (h * m.q_lora + m.q_lora + m.q_lora * a * m.qk_dim) if m.q_lora else h * a * m.qk_dim
        kv = h * (m.kv_lora + m.qk_rope) + m.kv_lora + m.kv_lora * a * (m.qk_nope + m.v_head)
        return q + kv + a * m.v_head * h
    proj = h * (a + 2 * m.kv_heads) * m.head_dim + a * m.head_dim * h
    return proj + (3 * h + h if m.gpt else 0)


def dense_mlp_params(m: ModelSpec) -> int:
    return 2 * m.hidden * m.ffn + m.ffn + m.hidden if m.gpt else 3 * m.hidden * m.ffn


def expert_params(m: ModelSpec) -> int:
    """One routed (or shared) expert: a SwiGLU of width moe_ffn."""
    return 3 * m.hidden * m.moe_ffn


def norm_params(m: ModelSpec) -> int:
    """One norm's parameters: RMSNorm weight h, LayerNorm weight and bias 2h."""
    return 2 * m.hidden if m.gpt else m.hidden


def layer_params(m: ModelSpec, moe: bool) -> dict[str, int]:
    """One transformer layer by part: attention, MLP (dense) or routed experts + shared + router (MoE), norms."""
    parts = {"attention": attention_params(m), "norms": 2 * norm_params(m)}
    if moe:
        parts.update({"routed experts": m.experts * expert_params(m), "shared experts": m.shared_experts * expert_params(m),
                      "router": m.hidden * m.experts})
    else:
        parts["mlp"] = dense_mlp_params(m)
    return parts


def matrix_params_per_layer(m: ModelSpec) -> int:
    """The matrices of one dense layer, no biases or norms: Korthikanti et al.'s 12h² for their GPT models."""
    attention = attention_params(m) - (4 * m.hidden if m.gpt else 0) - (m.kv_lora + m.q_lora if m.mla else 0)
    return attention + (2 * m.hidden * m.ffn if m.gpt else 3 * m.hidden * m.ffn)


def counts(m: ModelSpec) -> dict[str, int]:
    """Total and per-token-active parameters, with embedding and output head apart."""
    dense, moe = layer_params(m, False), layer_params(m, True) if m.experts else {}
    n_dense, n_moe = m.layers - m.moe_layers, m.moe_layers
    embed = (m.vocab + m.positions) * m.hidden
    head = 0 if m.tied else m.vocab * m.hidden
    final_norm = norm_params(m)
    layers = n_dense * sum(dense.values()) + n_moe * sum(moe.values())
    active_moe = (sum(moe.values()) - moe["routed experts"] + m.top_k * expert_params(m)) if m.experts else 0
    active_layers = n_dense * sum(dense.values()) + n_moe * active_moe
    return {"total": layers + embed + head + final_norm, "active": active_layers + embed + head + final_norm,
            "layers": layers, "embedding": embed, "head": head, "final_norm": final_norm,
            "dense_layer": sum(dense.values()), "moe_layer": sum(moe.values()) if moe else 0,
            "expert": expert_params(m) if m.experts else 0}


def linear_params_per_token(m: ModelSpec) -> float:
    """Parameters a token multiplies through (2 FLOPs each forward): every matrix on its path, the head included,
    not the embedding lookup, biases or norms; routed experts count top_k of them."""
    per_dense = matrix_params_per_layer(m)
    attention = per_dense - (2 * m.hidden * m.ffn if m.gpt else 3 * m.hidden * m.ffn)
    per_moe = attention + (m.top_k + m.shared_experts) * expert_params(m) + m.hidden * m.experts if m.experts else 0
    return (m.layers - m.moe_layers) * per_dense + m.moe_layers * per_moe + m.vocab * m.hidden


def training_flops_per_token(m: ModelSpec, seq: int, causal: bool = False) -> dict[str, float]:
    """FLOPs of one token's forward and backward (3x the forward): 6 per linear parameter on its path and the
    attention scores and weighted sum, 6·s·a·(d_qk + d_v) per layer for the full s×s product (as FlopCounterMode
    counts non-flash attention, and Narayanan et al.'s formula; with standard heads 12·s·a·d, estimate.training's
    12·L·T·d_attn). causal: only the s(s+1)/2 query-key pairs a causal mask keeps, the work FlashAttention's causal
    kernel does (it skips the masked blocks) and the count of useful FLOPs."""
    linear = 6.0 * linear_params_per_token(m)
    attention = 6.0 * m.layers * seq * m.heads * (m.qk_dim + m.v_dim) * (causal_fraction(seq) if causal else 1.0)
    return {"linear": linear, "attention": attention, "total": linear + attention}


def causal_fraction(seq: int) -> float:
    """Share of the s×s query-key pairs a causal mask keeps: s(s+1)/2 of s²."""
    return (seq + 1) / (2 * seq)


def causal(m: ModelSpec) -> bool:
    """Whether a model's attention is run (and its FLOPs counted) causally: FlashAttention for the Llama family, DeepSeek and
    Mixtral (torchtitan, Megatron-Core); Korthikanti's and Narayanan's GPT models on Megatron's fused softmax over the
    full s×s scores, counted in full by their formula."""
    return not m.gpt


# Published totals: (parameters, how they were counted, relative tolerance the rounding of the figure allows).
PUBLISHED_PARAMS = {
    "llama-2-7b": (6_738_415_616, "meta-llama/Llama-2-7b-hf safetensors index, total parameters", 0.0),
    "llama-2-13b": (13_015_864_320, "meta-llama/Llama-2-13b-hf safetensors index, total parameters", 0.0),
    "llama-2-70b": (68_976_648_192, "meta-llama/Llama-2-70b-hf safetensors index, total parameters", 0.0),
    "llama-3-8b": (8_030_261_248, "meta-llama/Meta-Llama-3-8B safetensors index, total parameters", 0.0),
    "llama-3-70b": (70_553_706_496, "meta-llama/Meta-Llama-3-70B safetensors index, total parameters", 0.0),
    "llama-3.1-405b": (405_853_388_800, "meta-llama/Llama-3.1-405B safetensors index, total parameters", 0.0),
    "mixtral-8x7b": (46_702_792_704, "mistralai/Mixtral-8x7B-v0.1 safetensors index, total parameters", 0.0),
    "deepseek-v3": (671e9, "DeepSeek-V3 technical report: 671B total (the 14B multi-token-prediction module apart)", 0.001),
    "gpt-3-175b": (175.0e9, "Brown et al. 2020, Table 2.1: 175.0B", 0.003),
    "megatron-gpt-22b": (22e9, "Korthikanti et al. 2022, Table 3: 22B", 0.005),
    "megatron-gpt-175b": (175e9, "Korthikanti et al. 2022, Table 3: 175B", 0.005),
    "megatron-gpt-530b": (530e9, "Korthikanti et al. 2022, Table 3: 530B", 0.005),
    "megatron-gpt-1t": (1e12, "Korthikanti et al. 2022, Table 3: 1T", 0.01),
}
PUBLISHED_ACTIVE = {"mixtral-8x7b": (12.9e9, "Mistral AI: 12.9B active parameters per token", 0.005),
                    "deepseek-v3": (37e9, "DeepSeek-V3 technical report: 37B activated", 0.02)}
