"""The one model description: ``ModelSpec``, parsed from a HF ``config.json`` (pure: no torch, no I/O but the read).

Contract
- ``ModelSpec.from_hf_config(hf, generation_config=None, where="config.json")`` reads the decoder
  family every part runs (Qwen2/Qwen2.5, Qwen3, Llama: SwiGLU, RMSNorm, RoPE, grouped-query attention) and
  Qwen3-MoE (``qwen3_moe``: Qwen3's attention, top-k routed SwiGLU experts, ``num_experts`` > 0).
  A missing or ill-typed field, or a model outside that family (``model_type``, ``hidden_act``,
  ``mlp_bias``, ``use_sliding_window``), is a ValueError naming ``where`` and the field.
  ``ModelSpec.from_pretrained(dir)`` reads ``dir/config.json`` (+ ``generation_config.json`` for the EOS ids).
- What one consumer cannot run is refused by that consumer, the same way everywhere:
  ``require(spec, ACTOR | CPU_ENGINE | TORCH_DECODER)`` raises a ValueError naming the field, the value,
  the consumer and what it supports. Today: RoPE scaling (``linear``, ``llama3``) runs on the CPU engine and
  the plain-PyTorch decoder, not in the actor (megatron-core's plain RoPE); an ``o_proj`` bias (Llama/Qwen3
  ``attention_bias``) likewise. Every consumer refuses other RoPE types (``yarn``, ``dynamic``, ...).
  The launcher applies the same refusal before any process starts (``asyncrl.runner.launcher.check_models``).
- Field names follow Megatron (``ffn_hidden_size``, ``num_query_groups``); the HF key each comes from is
  in its docstring.

    spec = require(ModelSpec.from_pretrained("runs/tiny/model"), CPU_ENGINE)
    spec.num_query_groups, spec.head_dim, spec.rope_scaling   # 2, 64, None
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

SUPPORTED_MODEL_TYPES = ("qwen2", "qwen3", "llama", "qwen3_moe")
MOE_MODEL_TYPES = ("qwen3_moe",)
"""Mixture-of-experts families: Qwen3's decoder with a top-k routed SwiGLU expert MLP (no shared expert)."""
ROPE_TYPES = ("default", "linear", "llama3")
"""RoPE variants ``asyncrl.models.rope`` computes (``default`` = plain RoPE, stored as ``rope_scaling = None``)."""
_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
}


@dataclass(frozen=True)
class ModelSpec:
    """One HF decoder's architecture, as the actor, the converter, the CPU engine, the warm start and the
    memory estimate read it."""

    model_type: str
    """``model_type``: qwen2, qwen3 or llama."""
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    """``intermediate_size``."""
    num_layers: int
    """``num_hidden_layers``."""
    num_attention_heads: int
    num_query_groups: int
    """``num_key_value_heads`` (= ``num_attention_heads`` when absent)."""
    head_dim: int
    """``head_dim`` (= ``hidden_size / num_attention_heads`` when absent)."""
    rms_norm_eps: float
    rope_theta: float
    """``rope_theta`` (or ``rope_parameters.rope_theta``, transformers 5), default 10000."""
    rope_scaling: Optional[dict]
    """``rope_scaling`` (or a non-default ``rope_parameters``) with ``rope_type`` set; None for plain RoPE."""
    max_position_embeddings: int
    qkv_bias: bool
    """Bias on q/k/v: always for qwen2, ``attention_bias`` otherwise."""
    o_bias: bool
    """Bias on ``o_proj``: ``attention_bias`` for llama and qwen3 (qwen2 has none)."""
    qk_norm: bool
    """RMSNorm of q and k per head (qwen3)."""
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...] = ()
    """``eos_token_id`` of config.json then generation_config.json (int or list), in order, no repeats."""
    source: str = field(default="config.json", compare=False)
    """Where it was read (named in the errors of ``require``)."""
    num_experts: int = 0
    """``num_experts`` (``num_local_experts`` as transformers 5 writes it); 0 for a dense model."""
    num_experts_per_tok: int = 0
    """``num_experts_per_tok``: the router's top-k."""
    moe_ffn_hidden_size: int = 0
    """``moe_intermediate_size``: each expert's SwiGLU width (dense layers keep ``ffn_hidden_size``)."""
    norm_topk_prob: bool = False
    """``norm_topk_prob``: the top-k routing probabilities renormalised to sum to 1 (softmax over the top-k
    logits); otherwise they are the full softmax's values, unnormalised."""
    moe_layers: tuple[int, ...] = ()
    """Indices of the sparse (MoE) layers: layer ``i`` is sparse unless ``i`` is in ``mlp_only_layers``, and only
    when ``(i + 1) % decoder_sparse_step == 0`` (HF's rule); the others are dense SwiGLU layers."""
    router_aux_loss_coef: float = 0.0
    """``router_aux_loss_coef``: weight of the load-balancing loss (the actor's default for
    ``actor.moe_aux_loss_coeff``)."""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, layer: int) -> bool:
        return layer in self.moe_layers

    @classmethod
    def from_hf_config(
        cls, hf: dict[str, Any], generation_config: Optional[dict] = None, *, where: str = "config.json"
    ) -> ModelSpec:
        return parse_hf_config(hf, generation_config, where=where)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelSpec:
        p = Path(path)
        gen = p / "generation_config.json"
        return parse_hf_config(
            load_hf_config(p), read_json(gen) if gen.is_file() else None, where=str(p / "config.json")
        )


def read_eos_token_ids(path: str | Path) -> tuple[int, ...]:
    """The EOS ids of a HF directory as ``ModelSpec.eos_token_ids`` has them (``config.json`` then
    ``generation_config.json``, in order, no repeats), for readers that need no decoder (a tokenizer directory may
    lack ``config.json``); files that are absent count as empty."""
    p = Path(path)
    return _eos_ids(
        *(read_json(p / n) if (p / n).is_file() else None for n in ("config.json", "generation_config.json"))
    )


def read_json(path: Path) -> dict:
    try:
        out = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: invalid JSON: {e}") from None
    if not isinstance(out, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(out).__name__}")
    return out


def load_hf_config(path: str | Path) -> dict[str, Any]:
    """``path/config.json`` as a dict (a ValueError naming the directory when there is none)."""
    p = Path(path) / "config.json"
    if not p.is_file():
        raise ValueError(f"{str(Path(path))!r} has no config.json (not a HF checkpoint directory)")
    return read_json(p)


def _int(hf: dict, key: str, where: str, default: Optional[int] = None) -> int:
    v = hf.get(key)
    if v is None:
        if default is None:
            raise ValueError(f"{where}: {key} is missing")
        return default
    if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
        raise ValueError(f"{where}: {key}={v!r} must be a positive integer")
    return v


def _float(value: Any, key: str, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"{where}: {key}={value!r} must be a positive number")
    return float(value)


def _rope(hf: dict, where: str) -> tuple[float, Optional[dict]]:
    params = hf.get("rope_parameters") or {}
    if not isinstance(params, dict):
        raise ValueError(f"{where}: rope_parameters={params!r} must be an object")
    scaling = hf.get("rope_scaling") or None
    if scaling is None and params.get("rope_type", "default") != "default":  # transformers 5 layout
        scaling, key = params, "rope_parameters"
    else:
        key = "rope_scaling"
    theta = hf.get("rope_theta")
    if theta is None:
        theta = params.get("rope_theta", 10000.0)
    theta = _float(theta, "rope_theta", where)
    if scaling is None:
        return theta, None
    if not isinstance(scaling, dict):
        raise ValueError(f"{where}: {key}={scaling!r} must be an object")
    rtype = scaling.get("rope_type", scaling.get("type", "default"))
    if rtype == "default":
        return theta, None
    for k in _ROPE_KEYS.get(rtype, ()):
        if k not in scaling:
            raise ValueError(f"{where}: {key}.{k} is missing (needed by rope_type={rtype!r})")
        _float(scaling[k], f"{key}.{k}", where)
    return theta, {**scaling, "rope_type": rtype}


def _eos_ids(*sources: Optional[dict]) -> tuple[int, ...]:
    eos: list[int] = []
    for src in sources:
        e = (src or {}).get("eos_token_id")
        for t in [] if e is None else e if isinstance(e, list) else [e]:
            if int(t) not in eos:
                eos.append(int(t))
    return tuple(eos)


def parse_hf_config(
    hf: dict[str, Any], generation_config: Optional[dict] = None, *, where: str = "config.json"
) -> ModelSpec:
    """``ModelSpec.from_hf_config``; errors name ``where`` and the field at fault."""
    mt = hf.get("model_type")
    if mt not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"{where}: model_type={mt!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"{where}: hidden_act={hf.get('hidden_act')!r} is not supported (only 'silu', SwiGLU)")
    if hf.get("mlp_bias"):
        raise ValueError(f"{where}: mlp_bias=true is not supported")
    if hf.get("use_sliding_window"):
        raise ValueError(f"{where}: use_sliding_window=true is not supported (full attention only)")
    h = _int(hf, "hidden_size", where)
    nh = _int(hf, "num_attention_heads", where)
    nkv = _int(hf, "num_key_value_heads", where, default=nh)
    if nh % nkv:
        raise ValueError(f"{where}: num_key_value_heads={nkv} must divide num_attention_heads={nh}")
    if hf.get("head_dim") is None and h % nh:
        raise ValueError(
            f"{where}: head_dim is missing and hidden_size={h} is not a multiple of num_attention_heads={nh}"
        )
    theta, scaling = _rope(hf, where)
    attention_bias = bool(hf.get("attention_bias", False))
    moe = _moe(hf, where) if mt in MOE_MODEL_TYPES else {}
    return ModelSpec(
        model_type=mt,
        vocab_size=_int(hf, "vocab_size", where),
        hidden_size=h,
        ffn_hidden_size=_int(hf, "intermediate_size", where),
        num_layers=_int(hf, "num_hidden_layers", where),
        num_attention_heads=nh,
        num_query_groups=nkv,
        head_dim=_int(hf, "head_dim", where, default=h // nh),
        rms_norm_eps=_float(hf.get("rms_norm_eps", 1e-6), "rms_norm_eps", where),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=_int(hf, "max_position_embeddings", where, default=4096),
        qkv_bias=mt == "qwen2" or attention_bias,
        o_bias=mt != "qwen2" and attention_bias,
        qk_norm=mt in ("qwen3", "qwen3_moe"),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
        eos_token_ids=_eos_ids(hf, generation_config),
        source=where,
        **moe,
    )


def _moe(hf: dict, where: str) -> dict[str, Any]:
    """The MoE fields of a ``qwen3_moe`` config.json (see ``ModelSpec``); errors name the field."""
    if hf.get("num_experts") is not None:
        n_exp = _int(hf, "num_experts", where)
    else:  # transformers 5 writes the count as num_local_experts
        n_exp = _int(hf, "num_local_experts", where)
    topk = _int(hf, "num_experts_per_tok", where)
    if topk > n_exp:
        raise ValueError(f"{where}: num_experts_per_tok={topk} is larger than num_experts={n_exp}")
    layers = _int(hf, "num_hidden_layers", where)
    step = _int(hf, "decoder_sparse_step", where, default=1)
    only = hf.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise ValueError(f"{where}: mlp_only_layers={only!r} must be a list of layer indices")
    bad = [i for i in only if not 0 <= i < layers]
    if bad:
        raise ValueError(f"{where}: mlp_only_layers has {bad}, outside the {layers} layers")
    for key in ("shared_expert_intermediate_size", "moe_shared_expert_intermediate_size"):
        if hf.get(key):
            raise ValueError(f"{where}: {key}={hf[key]!r}: shared experts are not supported (Qwen3-MoE has none)")
    coef = hf.get("router_aux_loss_coef", 0.001)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
        raise ValueError(f"{where}: router_aux_loss_coef={coef!r} must be a number >= 0")
    sparse = tuple(i for i in range(layers) if i not in only and (i + 1) % step == 0)
    if not sparse:
        raise ValueError(f"{where}: no layer is sparse (mlp_only_layers={only}, decoder_sparse_step={step})")
    return {
        "num_experts": n_exp,
        "num_experts_per_tok": topk,
        "moe_ffn_hidden_size": _int(hf, "moe_intermediate_size", where),
        "norm_topk_prob": bool(hf.get("norm_topk_prob", False)),
        "moe_layers": sparse,
        "router_aux_loss_coef": float(coef),
    }


# ------------------------------------------------------------------------------------------- consumers
@dataclass(frozen=True)
class Consumer:
    """What one part runs beyond the family every part runs."""

    name: str
    rope_types: tuple[str, ...]
    o_bias: bool


ACTOR = Consumer("the actor (megatron-core)", rope_types=("default",), o_bias=False)
CPU_ENGINE = Consumer("the CPU engine", rope_types=ROPE_TYPES, o_bias=True)
TORCH_DECODER = Consumer("the plain-PyTorch decoder (warm start)", rope_types=ROPE_TYPES, o_bias=True)


def require(spec: ModelSpec, consumer: Consumer) -> ModelSpec:
    """``spec`` if ``consumer`` runs it, else a ValueError naming the field, the consumer and what it supports."""
    where = spec.source
    rtype = spec.rope_scaling["rope_type"] if spec.rope_scaling else "default"
    if rtype not in consumer.rope_types:
        raise ValueError(
            f"{where}: rope_scaling.rope_type={rtype!r} is not supported by {consumer.name} "
            f"(supported: {', '.join(consumer.rope_types)})"
        )
    if spec.o_bias and not consumer.o_bias:
        raise ValueError(
            f"{where}: attention_bias=true ({spec.model_type}: an o_proj bias) is not supported by {consumer.name}"
        )
    return spec
