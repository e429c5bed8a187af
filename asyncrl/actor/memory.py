"""Per-rank memory estimate of the actor on a GPU (pure: no torch, no I/O).

``estimate_actor_memory(shape, ...)`` adds up what one actor rank holds at the peak of a training
step, in bytes:

- ``weights``: this rank's parameters (TP shard of the largest pipeline stage), bf16 or fp32;
- ``grads``: Megatron DDP's gradient buffer (fp32: the actor reduces gradients in fp32);
- ``optimizer``: Adam's two moments plus, with bf16 weights, the fp32 main copy (12 or 8 bytes a
  parameter), divided by DP with the distributed optimizer;
- ``ref_weights``: the frozen reference model (KL term), when there is one;
- ``activations``: what the backward pass keeps for one micro-batch of ``microbatch_tokens``
  tokens (``pp`` micro-batches in flight on the first stage of a 1F1B pipeline), per layer and
  token: the norms' inputs, normalized values and outputs, q/k/v before and after RoPE, the
  attention output, the SwiGLU's gate/up and product (checked against the tensors megatron-core
  saves for backward in ``tests/integration/test_actor_attention.py``). ``unfused`` attention adds
  the ``[heads, S, S]`` fp32 softmax and probabilities per row of ``row_len`` tokens; full recompute keeps only each recompute unit's
  input plus one unit's activations; selective recompute drops the ``S x S`` term;
- ``logits``: the forward peak of the log-probs: the micro-batch's logits and the response rows
  picked from them (activation dtype), and the fp32 softmax terms of the vocab-parallel log-prob
  and entropy (every position counted as a response token: an upper bound). At a 150k vocabulary
  this is the largest activation term; log-probs computed in chunks would shrink it.

It is an estimate (allocator fragmentation, NCCL and CUDA context come on top: the launcher
compares it with ``USABLE_FRACTION`` of the device). ``ModelShape.from_hf_config`` reads the
HF ``config.json`` through the one ``asyncrl.models.spec.ModelSpec``; ``known_shape(name)`` knows a
few public models by name, so a dry run works before the checkpoint is downloaded.

Example::

    est = estimate_actor_memory(known_shape("Qwen2.5-3B-Instruct"), tp=2, pp=1, dp=4, bf16=True,
                                microbatch_tokens=16384, row_len=4096)
    print(est.render())  # weights 2.9 GiB, grads ..., total ...
"""

from __future__ import annotations

from dataclasses import dataclass, fields
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
        )

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelShape:
        """The shape of a HF ``config.json`` dict, read as ``ModelSpec`` reads it (its errors name the field)."""
        return cls.from_spec(ModelSpec.from_hf_config(hf))


# (vocab, hidden, ffn, layers, heads, kv heads, head_dim, tied, q/k norm): from the models' public config.json
_KNOWN = {
    "qwen2.5-0.5b": (151936, 896, 4864, 24, 14, 2, 64, True, False),
    "qwen2.5-1.5b": (151936, 1536, 8960, 28, 12, 2, 128, True, False),
    "qwen2.5-3b": (151936, 2048, 11008, 36, 16, 2, 128, True, False),
    "qwen2.5-7b": (152064, 3584, 18944, 28, 28, 4, 128, False, False),
    "qwen2.5-14b": (152064, 5120, 13824, 48, 40, 8, 128, False, False),
    "qwen3-4b": (151936, 2560, 9728, 36, 32, 8, 128, True, True),
    "qwen3-8b": (151936, 4096, 12288, 36, 32, 8, 128, False, True),
}


def known_shape(name: str) -> ModelShape | None:
    """The shape of a known public model from a path or name like ``models/Qwen2.5-3B-Instruct``."""
    base = name.rstrip("/").rsplit("/", 1)[-1].lower()
    for suffix in ("-instruct", "-base"):
        base = base.removesuffix(suffix)
    v = _KNOWN.get(base)
    return ModelShape(*v, qkv_bias=not v[-1]) if v else None  # Qwen2.5: qkv bias; Qwen3: q/k norms


@dataclass(frozen=True)
class MemoryEstimate:
    weights: int
    grads: int
    optimizer: int
    ref_weights: int
    activations: int
    logits: int
    params_per_rank: int

    @property
    def total(self) -> int:
        return self.weights + self.grads + self.optimizer + self.ref_weights + self.activations + self.logits

    def render(self) -> str:
        unit, div = ("GiB", GIB) if self.total >= GIB else ("MiB", 1024**2)
        parts = [f"{f.name} {getattr(self, f.name) / div:.1f}" for f in fields(self) if f.name != "params_per_rank"]
        return (
            f"{', '.join(parts)} -> total {self.total / div:.1f} {unit} per actor rank "
            f"({self.params_per_rank / 1e9:.3g}B parameters on the rank)"
        )


def params_per_rank(shape: ModelShape, *, tp: int, pp: int) -> int:
    """Parameters on the rank of the largest pipeline stage (the TP shard of its layers and vocab matrices)."""
    h, d, f = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    qkv = (shape.num_attention_heads + 2 * shape.num_query_groups) * d
    sharded = h * qkv + shape.num_attention_heads * d * h + 3 * f * h  # qkv, proj, fc1 (gate, up), fc2
    if shape.qkv_bias:
        sharded += qkv
    per_layer = sharded // tp + 2 * h + (2 * d if shape.qk_norm else 0)  # + the replicated norms
    vocab = -(-shape.vocab_size // (VOCAB_MULTIPLE * tp)) * VOCAB_MULTIPLE * tp
    matrix = vocab * h // tp
    if pp == 1:
        vocab_params = matrix if shape.tie_word_embeddings else 2 * matrix
    else:  # the first stage holds the embedding, the last the output layer (a copy when tied)
        vocab_params = matrix
    return -(-shape.num_layers // pp) * per_layer + vocab_params + h


def _activation_bytes_per_token_layer(shape: ModelShape, *, tp: int, act: int) -> int:
    h, d, f = shape.hidden_size, shape.head_dim, shape.ffn_hidden_size
    nh, ng = shape.num_attention_heads, shape.num_query_groups
    # two RMSNorms: input, normalized, output; q/k/v; RoPE's rotated half and output of q and k; attention output
    attn = 6 * h + ((nh + 2 * ng) + 2 * (nh + ng) + nh) * d // tp
    if shape.qk_norm:  # the q/k norms' normalized values and outputs
        attn += 2 * (nh + ng) * d // tp
    mlp = 4 * f // tp  # gate+up, silu(gate), product
    return act * (attn + mlp)


def estimate_actor_memory(
    shape: ModelShape,
    *,
    tp: int,
    pp: int,
    dp: int,
    bf16: bool,
    microbatch_tokens: int,
    row_len: int,
    distributed_optimizer: bool = False,
    ref_model: bool = False,
    attention: str = "fused",
    recompute_granularity: str = "none",
    recompute_method: str | None = None,
    recompute_num_layers: int | None = None,
) -> MemoryEstimate:
    """Bytes one actor rank needs at the peak of a training step (see the module docstring)."""
    act = 2 if bf16 else 4
    p = params_per_rank(shape, tp=tp, pp=pp)
    optimizer = p * (12 if bf16 else 8)
    if distributed_optimizer:
        optimizer = -(-optimizer // dp)
    layers = -(-shape.num_layers // pp)
    n = microbatch_tokens * pp  # 1F1B: up to pp micro-batches in flight on the first stage
    per_layer = n * _activation_bytes_per_token_layer(shape, tp=tp, act=act)
    if attention == "unfused" and recompute_granularity != "selective":
        rows = -(-n // row_len)
        # the fp32 softmax output and the probabilities, [heads/tp, S, S] per row
        per_layer += rows * (shape.num_attention_heads // tp) * row_len * row_len * (act + 4)
    layer_input = n * shape.hidden_size * act
    if recompute_granularity == "full":
        k = recompute_num_layers or 1
        if (recompute_method or "uniform") == "uniform":
            activations = -(-layers // k) * layer_input + min(k, layers) * per_layer
        else:  # block: the first k layers keep only their input
            k = min(k, layers)
            activations = k * layer_input + (layers - k) * per_layer + (per_layer if k else 0)
    else:
        activations = layers * per_layer
    activations += 4 * layer_input  # the embedding output; the final norm's input, normalized values, output
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
    )
