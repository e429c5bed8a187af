"""Per-rank memory estimate of the actor on a GPU (pure: no torch, no I/O).

``estimate_actor_memory(shape, ...)`` adds up what one actor rank holds at the peak of a training
step, in bytes:

- ``weights``: this rank's parameters (TP shard of the largest pipeline stage), bf16 or fp32; for a
  mixture-of-experts model the dense part (attention, norms, routers, dense MLPs, vocab matrices: split by TP
  and PP) plus the rank's ``num_experts / EP`` experts of each MoE layer of its stage, split by the experts'
  TP (= TP: megatron-core's ``expert_tensor_parallel_size`` defaults to it and the actor keeps it);
- ``grads``: Megatron DDP's gradient buffer (fp32: the actor reduces gradients in fp32);
- ``optimizer``: Adam's two moments plus, with bf16 weights, the fp32 main copy (12 or 8 bytes a
  parameter); with the distributed optimizer the dense part's is divided by DP and the experts' by the
  expert-DP (actor ranks / (TP x EP x PP) = DP / EP);
- ``ref_weights``: the frozen reference model (KL term), when there is one;
- ``activations``: what the backward pass keeps for one micro-batch of ``microbatch_tokens``
  tokens (``pp`` micro-batches in flight on the first stage of a 1F1B pipeline), per layer and
  token: the norms' inputs, normalized values and outputs, q/k/v before and after RoPE, the
  attention output, the SwiGLU's gate/up and product (checked against the tensors megatron-core
  saves for backward in ``tests/integration/test_actor_attention.py``); an MoE layer keeps instead the
  router's logits and scores and, per routed copy of a token (``num_experts_per_tok`` a token: what an EP
  rank receives on average, balanced routing assumed), the dispatched input and its expert's SwiGLU
  terms. ``unfused`` attention adds
  the ``[heads, S, S]`` fp32 softmax and probabilities per row of ``row_len`` tokens; full recompute keeps only each recompute unit's
  input plus one unit's activations; selective recompute drops the ``S x S`` term;
- ``logits``: the forward peak of the log-probs: the micro-batch's logits and the response rows
  picked from them (activation dtype), and the fp32 softmax terms of the vocab-parallel log-prob
  and entropy (every position counted as a response token: an upper bound). At a 150k vocabulary
  this is the largest activation term; log-probs computed in chunks would shrink it.

It is an estimate (allocator fragmentation, NCCL and CUDA context come on top: the launcher
compares it with ``USABLE_FRACTION`` of the device). ``ModelShape.from_hf_config`` reads the
HF ``config.json`` through the one ``asyncrl.models.spec.ModelSpec``; ``known_shape(name)`` knows a
few public models by name (their config.json facts, read the same way), so a dry run works before the
checkpoint is downloaded.

Example::

    est = estimate_actor_memory(known_shape("Qwen2.5-3B-Instruct"), tp=2, pp=1, dp=4, bf16=True,
                                microbatch_tokens=16384, row_len=4096)
    print(est.render())  # weights 2.9 GiB, grads ..., total ...
    moe = estimate_actor_memory(known_shape("Qwen3-30B-A3B"), tp=1, pp=1, dp=8, ep=8, bf16=True, ...)
    moe.local_experts, moe.expert_params_per_rank  # 16 experts of each MoE layer on the rank, their parameters
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from asyncrl.models.spec import ModelSpec

GIB = 1024**3
VOCAB_MULTIPLE = 128
"""As ``asyncrl.actor.model.VOCAB_MULTIPLE``: the vocab is padded to a multiple of this x TP."""
USABLE_FRACTION = 0.9
"""Share of a GPU's memory the estimate may use: CUDA context, NCCL buffers and fragmentation take the rest."""


@dataclass(frozen=True)
class ModelShape:
    vocab_size: int
    hidden_size: int
    ffn_hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_query_groups: int
    head_dim: int
    tie_word_embeddings: bool
    qk_norm: bool = False
    qkv_bias: bool = True
    num_experts: int = 0
    """Routed experts of each MoE layer (0: a dense model); the fields below as ``ModelSpec`` has them."""
    num_experts_per_tok: int = 0
    moe_ffn_hidden_size: int = 0
    moe_layers: tuple[int, ...] = ()

    @classmethod
    def from_spec(cls, spec: ModelSpec) -> ModelShape:
        return cls(
            vocab_size=spec.vocab_size,
            hidden_size=spec.hidden_size,
            ffn_hidden_size=spec.ffn_hidden_size,
            num_layers=spec.num_layers,
            num_attention_heads=spec.num_attention_heads,
            num_query_groups=spec.num_query_groups,
            head_dim=spec.head_dim,
            tie_word_embeddings=spec.tie_word_embeddings,
            qk_norm=spec.qk_norm,
            qkv_bias=spec.qkv_bias,
            num_experts=spec.num_experts,
            num_experts_per_tok=spec.num_experts_per_tok,
            moe_ffn_hidden_size=spec.moe_ffn_hidden_size,
            moe_layers=spec.moe_layers,
        )

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelShape:
        """The shape of a HF ``config.json`` dict, read as ``ModelSpec`` reads it (its errors name the field)."""
        return cls.from_spec(ModelSpec.from_hf_config(hf))


# config.json facts of public models: (model_type, vocab, hidden, ffn, layers, heads, kv heads, head_dim, tied)
_KNOWN_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "tie_word_embeddings",
)
_KNOWN = {
    "qwen2.5-0.5b": ("qwen2", 151936, 896, 4864, 24, 14, 2, 64, True),
    "qwen2.5-1.5b": ("qwen2", 151936, 1536, 8960, 28, 12, 2, 128, True),
    "qwen2.5-3b": ("qwen2", 151936, 2048, 11008, 36, 16, 2, 128, True),
    "qwen2.5-7b": ("qwen2", 152064, 3584, 18944, 28, 28, 4, 128, False),
    "qwen2.5-14b": ("qwen2", 152064, 5120, 13824, 48, 40, 8, 128, False),
    "qwen3-4b": ("qwen3", 151936, 2560, 9728, 36, 32, 8, 128, True),
    "qwen3-8b": ("qwen3", 151936, 4096, 12288, 36, 32, 8, 128, False),
    "qwen3-30b-a3b": ("qwen3_moe", 151936, 2048, 6144, 48, 32, 4, 128, False),
}
_KNOWN_MOE = {
    "qwen3-30b-a3b": {
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "router_aux_loss_coef": 0.001,
        "rope_theta": 1000000.0,
        "max_position_embeddings": 40960,
    },
}


def known_shape(name: str) -> ModelShape | None:
    """The shape of a known public model from a path or name like ``models/Qwen2.5-3B-Instruct``."""
    base = name.rstrip("/").rsplit("/", 1)[-1].lower()
    for suffix in ("-instruct", "-base"):
        base = base.removesuffix(suffix)
    v = _KNOWN.get(base)
    if v is None:
        return None
    hf = {**dict(zip(_KNOWN_FIELDS, v)), **_KNOWN_MOE.get(base, {})}
    return ModelShape.from_hf_config(hf)


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    grads: int
    optimizer: int
    ref_weights: int
    activations: int
    logits: int
    params_per_rank: int
    expert_params_per_rank: int = 0
    """Of ``params_per_rank``, the parameters of the rank's experts (0 for a dense model)."""
    local_experts: int = 0
    """Experts of each MoE layer on the rank (``num_experts / EP``; 0 for a dense model)."""
    num_experts: int = 0

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.ref_weights + self.activations + self.logits

    def render(self) -> str:
        unit, div = ("GiB", GIB) if self.total >= GIB else ("MiB", 1024**2)
        parts = [f"{name} {getattr(self, name) / div:.1f}" for name in _BYTE_TERMS]
        params = f"{self.params_per_rank / 1e9:.3g}B parameters on the rank"
        if self.num_experts:
            dense = self.params_per_rank - self.expert_params_per_rank
            params += (
                f": {dense / 1e9:.3g}B dense + {self.expert_params_per_rank / 1e9:.3g}B in "
                f"{self.local_experts} of the {self.num_experts} experts of each MoE layer"
            )
        return f"{', '.join(parts)} -> total {self.total / div:.1f} {unit} per actor rank ({params})"


_BYTE_TERMS = ("weights", "grads", "optimizer", "ref_weights", "activations", "logits")


def _stage_params(shape: ModelShape, *, tp: int, pp: int, ep: int) -> tuple[int, int]:
    """(dense, experts) parameters on a rank of the largest pipeline stage (see ``params_per_rank``)."""
    h, d, f = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    qkv = (shape.num_attention_heads + 2 * shape.num_query_groups) * d
    sharded = h * qkv + shape.num_attention_heads * d * h  # qkv, proj
    if shape.qkv_bias:
        sharded += qkv
    attn = sharded // tp + 2 * h + (2 * d if shape.qk_norm else 0)  # + the replicated norms
    dense_mlp = 3 * f * h // tp  # fc1 (gate, up), fc2
    router = shape.num_experts * h  # replicated on every rank
    experts = shape.num_experts // ep * 3 * shape.moe_ffn_hidden_size * h // tp  # each expert split by TP
    per_stage = -(-shape.num_layers // pp)
    stages = []
    for first in range(0, shape.num_layers, per_stage):
        layers = range(first, min(first + per_stage, shape.num_layers))
        n_moe = sum(i in shape.moe_layers for i in layers)
        dense = len(layers) * attn + n_moe * router + (len(layers) - n_moe) * dense_mlp
        stages.append((dense + n_moe * experts, dense, n_moe * experts))
    _, dense, expert = max(stages)
    vocab = -(-shape.vocab_size // (VOCAB_MULTIPLE * tp)) * VOCAB_MULTIPLE * tp
    matrix = vocab * h // tp
    if pp == 1:
        vocab_params = matrix if shape.tie_word_embeddings else 2 * matrix
    else:  # the first stage holds the embedding, the last the output layer (a copy when tied)
        vocab_params = matrix
    return dense + vocab_params + h, expert


def params_per_rank(shape: ModelShape, *, tp: int, pp: int, ep: int = 1) -> int:
    """Parameters on the rank of the largest pipeline stage: the TP shard of its layers and vocab matrices and, for a
    mixture-of-experts model, its ``num_experts / ep`` experts of each MoE layer (each split by TP)."""
    return sum(_stage_params(shape, tp=tp, pp=pp, ep=ep))


def expert_params_per_rank(shape: ModelShape, *, tp: int, pp: int, ep: int = 1) -> int:
    """Of ``params_per_rank``, the experts' parameters (reduced over the expert-DP group, not DP); 0 when dense."""
    return _stage_params(shape, tp=tp, pp=pp, ep=ep)[1]


def _activation_bytes_per_token_layer(shape: ModelShape, *, tp: int, act: int, moe: bool) -> int:
    h, d, f = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    nh, ng = shape.num_attention_heads, shape.num_query_groups
    # two RMSNorms: input, normalized, output; q/k/v; RoPE's rotated half and output of q and k; attention output
    attn = 6 * h + ((nh + 2 * ng) + 2 * (nh + ng) + nh) * d // tp
    if shape.qk_norm:  # the q/k norms' normalized values and outputs
        attn += 2 * (nh + ng) * d // tp
    if moe:  # router logits and scores; per routed copy: the dispatched input, gate+up, silu(gate), product
        mlp = 2 * shape.num_experts + shape.num_experts_per_tok * (h + 4 * shape.moe_ffn_hidden_size // tp)
    else:
        mlp = 4 * f // tp  # gate+up, silu(gate), product
    return act * (attn + mlp)


def _activations(
    shape: ModelShape,
    *,
    tp: int,
    pp: int,
    act: int,
    microbatch_tokens: int,
    row_len: int,
    unfused: bool,
    recompute: tuple[str, str, int],
) -> int:
    """The first stage's saved activations (``pp`` micro-batches in flight under 1F1B); ``recompute`` is
    (granularity, method, layers per unit)."""
    granularity, method, k = recompute
    n = microbatch_tokens * pp
    layers = range(-(-shape.num_layers // pp))
    per_layer = [
        n * _activation_bytes_per_token_layer(shape, tp=tp, act=act, moe=i in shape.moe_layers) for i in layers
    ]
    if unfused and granularity != "selective":
        rows = -(-n // row_len)
        # the fp32 softmax output and the probabilities, [heads/tp, S, S] per row
        per_layer = [b + rows * (shape.num_attention_heads // tp) * row_len * row_len * (act + 4) for b in per_layer]
    layer_input = n * shape.hidden_size * act
    if granularity == "full":
        k = min(k, len(per_layer))
        if method == "uniform":
            saved = -(-len(per_layer) // k) * layer_input + k * max(per_layer)
        else:  # block: the first k layers keep only their input, one of them recomputed at a time
            saved = k * layer_input + sum(per_layer[k:]) + (max(per_layer[:k]) if k else 0)
    else:
        saved = sum(per_layer)
    return saved + 4 * layer_input  # the embedding output; the final norm's input, normalized values, output


def _check_experts(shape: ModelShape, *, ep: int, dp: int) -> None:
    if ep > 1 and not shape.num_experts:
        raise ValueError(f"ep={ep}: expert parallelism needs a mixture-of-experts model (this one is dense)")
    if shape.num_experts % ep or dp % ep:
        raise ValueError(f"ep={ep} must divide num_experts={shape.num_experts} and dp={dp}")


def estimate_actor_memory(
    shape: ModelShape,
    *,
    tp: int,
    pp: int,
    dp: int,
    bf16: bool,
    microbatch_tokens: int,
    row_len: int,
    ep: int = 1,
    distributed_optimizer: bool = False,
    ref_model: bool = False,
    attention: str = "fused",
    recompute_granularity: str = "none",
    recompute_method: str | None = None,
    recompute_num_layers: int | None = None,
) -> MemoryEstimate:
    """Bytes one actor rank needs at the peak of a training step (see the module docstring); ``dp`` is the
    actor ranks / (TP x PP), ``ep`` the experts' parallelism (expert-DP = ``dp / ep``)."""
    _check_experts(shape, ep=ep, dp=dp)
    act = 2 if bf16 else 4
    p = params_per_rank(shape, tp=tp, pp=pp, ep=ep)
    e = expert_params_per_rank(shape, tp=tp, pp=pp, ep=ep)
    per_param = 12 if bf16 else 8
    if distributed_optimizer:
        optimizer = -(-(p - e) * per_param // dp) + -(-e * per_param // (dp // ep))
    else:
        optimizer = p * per_param
    activations = _activations(
        shape,
        tp=tp,
        pp=pp,
        act=act,
        microbatch_tokens=microbatch_tokens,
        row_len=row_len,
        unfused=attention == "unfused",
        recompute=(recompute_granularity, recompute_method or "uniform", recompute_num_layers or 1),
    )
    vocab = -(-shape.vocab_size // (VOCAB_MULTIPLE * tp)) * VOCAB_MULTIPLE * tp
    # the logits, the response rows picked from them, and four fp32 [T, V/tp] tensors of the
    # vocab-parallel log-softmax (logits, shifted logits, exp -- the last two kept for backward -- and
    # the entropy's product), with every position counted as a response token
    logits = microbatch_tokens * (vocab // tp) * (2 * act + 16)
    return MemoryEstimate(
        weights=p * act,
        grads=p * 4,
        optimizer=optimizer,
        ref_weights=p * act if ref_model else 0,
        activations=activations,
        logits=logits,
        params_per_rank=p,
        expert_params_per_rank=e,
        local_experts=shape.num_experts // ep,
        num_experts=shape.num_experts,
    )
