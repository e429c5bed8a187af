"""Build a megatron-core GPTModel from a HF ``config.json`` (Qwen2/Qwen2.5, Qwen3, Llama, Qwen3-MoE).

Pure description first (``actor_spec``: the one ``asyncrl.models.spec.ModelSpec``, refused where the actor
cannot run it, no torch.distributed; ``check_parallel_sizes``, ``check_trainable``, ``moe_settings``), then
``build_gpt_model`` which needs Megatron's model-parallel state to be initialised.

Mixture of experts (``spec.is_moe``): the sparse layers (``spec.moe_layers``) are megatron-core MoE layers,
the others dense (``moe_layer_freq`` as a 0/1 pattern). Routing is Qwen3-MoE's: softmax router in fp32 over
``num_experts``, top-k; ``norm_topk_prob`` (the top-k probabilities renormalised) is megatron-core's softmax
over the top-k logits (``moe_router_pre_softmax=False``), without it the full softmax's top-k values
(``pre_softmax=True``). Dropless (no capacity factor); the load-balancing loss is megatron-core's ``aux_loss``
with coefficient ``actor.moe_aux_loss_coeff`` (None: config.json's ``router_aux_loss_coef``; 0: none); the
alltoall token dispatcher on every device (on CPU through ``asyncrl.cluster.megatron_cpu``'s shim 7); the
experts are TE's grouped GEMM with the TE layer spec, megatron-core's ``SequentialMLP`` otherwise; EP =
``actor.expert_model_parallel_size`` ranks share the experts (expert TP = TP, megatron-core's default).

The vocabulary is padded to a multiple of ``vocab_multiple * tp`` (``padded_vocab_size``); the
extra rows of the embedding and the output layer are zero and are stripped on export.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any

import torch

from asyncrl.actor.layer_spec import layer_spec as make_layer_spec
from asyncrl.actor.names import canonical_megatron_name, tp_split_dim
from asyncrl.cluster.megatron_cpu import bind_router_gemm_fallback, cuda_as_cpu
from asyncrl.models.spec import ACTOR, ModelSpec, require

# Lazy imports here: megatron-core is imported inside the functions that use it; its import takes seconds
# and probes CUDA, and this module's pure parts (and --dry-run, the tests of them) must import without it.

VOCAB_MULTIPLE = 128
"""Padded vocab = multiple of VOCAB_MULTIPLE * TP (Megatron's ``make_vocab_size_divisible_by``)."""


def actor_spec(path: str | Path) -> ModelSpec:
    """The HF checkpoint at ``path`` as the actor runs it: ``asyncrl.models.spec.ModelSpec``, refused (a
    ValueError naming the field) where megatron-core's GPTModel cannot run it (``require(spec, ACTOR)``)."""
    if not (Path(path) / "config.json").is_file():
        raise ValueError(f"actor.model_path: no config.json in {str(Path(path))!r}")
    return require(ModelSpec.from_pretrained(path), ACTOR)


def padded_vocab_size(vocab_size: int, tp: int, multiple: int = VOCAB_MULTIPLE) -> int:
    m = multiple * tp
    return -(-vocab_size // m) * m


def check_parallel_sizes(spec: ModelSpec, *, tp: int, pp: int, ep: int = 1) -> None:
    """Raise ValueError naming the setting when the model cannot be split this way."""
    key = "actor.tensor_model_parallel_size"
    if spec.num_attention_heads % tp:
        raise ValueError(f"{key}={tp} must divide num_attention_heads={spec.num_attention_heads}")
    if spec.num_query_groups % tp:
        raise ValueError(f"{key}={tp} must divide num_key_value_heads={spec.num_query_groups}")
    dense_layers = len(spec.moe_layers) < spec.num_layers
    if dense_layers and spec.ffn_hidden_size % tp:
        raise ValueError(f"{key}={tp} must divide intermediate_size={spec.ffn_hidden_size}")
    if spec.is_moe and spec.moe_ffn_hidden_size % tp:
        raise ValueError(f"{key}={tp} must divide moe_intermediate_size={spec.moe_ffn_hidden_size}")
    if pp < 1 or spec.num_layers % pp:
        raise ValueError(
            f"actor.pipeline_model_parallel_size={pp} must divide num_hidden_layers={spec.num_layers} "
            "(the layers are split evenly over the pipeline stages)"
        )
    ekey = "actor.expert_model_parallel_size"
    if ep < 1:
        raise ValueError(f"{ekey}={ep} must be >= 1")
    if ep > 1 and not spec.is_moe:
        raise ValueError(f"{ekey}={ep}: {spec.model_type} is a dense model (no experts to split); set it to 1")
    if spec.is_moe and spec.num_experts % ep:
        raise ValueError(f"{ekey}={ep} must divide num_experts={spec.num_experts}")


def check_trainable(spec: ModelSpec, *, tp: int) -> None:
    """Raise ValueError where megatron-core 0.16.1 cannot train the model at this TP: its MoE layer refuses
    training at TP > 1 without sequence parallelism (without it the tensor-parallel experts would see every
    token TP times), which the actor does not use (nor can on CPU: torch's norms refuse it)."""
    if spec.is_moe and tp > 1:
        raise ValueError(
            f"actor.tensor_model_parallel_size={tp} with a mixture-of-experts model ({spec.model_type}): "
            "megatron-core trains MoE layers at TP > 1 only with sequence parallelism, which the actor does not "
            "use; set it to 1 and split the experts with actor.expert_model_parallel_size"
        )


def moe_settings(
    spec: ModelSpec, *, ep: int, aux_loss_coeff: float | None, grouped_gemm: bool, routing_replay: bool = False
) -> dict[str, Any]:
    """The MoE keywords of ``TransformerConfig`` (see the module docstring); ``{}`` for a dense model.
    ``routing_replay``: every router gets megatron-core's ``RouterReplay`` (``asyncrl.actor.moe.replay_routing``)."""
    if not spec.is_moe:
        return {}
    if spec.num_experts_per_tok == 1 and spec.norm_topk_prob:
        raise ValueError(
            f"{spec.source}: num_experts_per_tok=1 with norm_topk_prob=true (every token's weight 1, no gradient "
            "to the router) is refused by megatron-core's router"
        )
    coeff = spec.router_aux_loss_coef if aux_loss_coeff is None else float(aux_loss_coeff)
    if coeff < 0:
        raise ValueError(f"actor.moe_aux_loss_coeff={aux_loss_coeff} must be >= 0")
    return {
        "num_moe_experts": spec.num_experts,
        "moe_router_topk": spec.num_experts_per_tok,
        "moe_ffn_hidden_size": spec.moe_ffn_hidden_size,
        "moe_layer_freq": [int(spec.is_moe_layer(i)) for i in range(spec.num_layers)],
        "moe_router_score_function": "softmax",
        "moe_router_pre_softmax": not spec.norm_topk_prob,
        "moe_router_dtype": "fp32",
        "moe_router_load_balancing_type": "aux_loss" if coeff > 0 else "none",
        "moe_aux_loss_coeff": coeff,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": grouped_gemm,
        "expert_model_parallel_size": ep,
        "moe_enable_routing_replay": routing_replay,
    }


def layer_offset(spec: ModelSpec, *, pp: int, pp_rank: int) -> int:
    """Index of pipeline stage ``pp_rank``'s first layer (HF layer index = offset + local index)."""
    return pp_rank * (spec.num_layers // pp)


def transformer_config(
    spec: ModelSpec, *, tp: int, pp: int = 1, params_dtype: torch.dtype = torch.float32, **extra: Any
):
    from megatron.core.transformer.transformer_config import TransformerConfig

    if pp > 1:
        # p2p between stages: batched isend/irecv (gloo supports it) without the
        # torch.cuda.synchronize() Megatron adds after each batch (no CUDA stream to sync on CPU).
        extra = {"batch_p2p_comm": True, "batch_p2p_sync": torch.cuda.is_available(), **extra}
    bf16 = params_dtype == torch.bfloat16
    return TransformerConfig(
        num_layers=spec.num_layers,
        hidden_size=spec.hidden_size,
        ffn_hidden_size=spec.ffn_hidden_size,
        num_attention_heads=spec.num_attention_heads,
        num_query_groups=spec.num_query_groups,
        kv_channels=spec.head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=spec.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=spec.qkv_bias,
        qk_layernorm=spec.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        sequence_parallel=False,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=params_dtype,
        bf16=bf16,
        pipeline_dtype=params_dtype,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        masked_softmax_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        attention_softmax_in_fp32=True,
        perform_initialization=False,  # weights always come from a HF checkpoint
        # no CUDA graphs; megatron-core 0.16.1's own default ("full") warns that it is deprecated on every start
        cuda_graph_scope=[],
        **extra,
    )


def decoder_block_spec(spec: ModelSpec, backend: str, *, pp: int, pp_rank: int):
    """The layer specs of pipeline stage ``pp_rank``'s layers (a MoE layer's where ``spec.is_moe_layer``), and
    the final norm megatron-core gives a block built from one layer spec."""
    from megatron.core.transformer.transformer_block import LayerNormImpl, TransformerBlockSubmodules

    dense = make_layer_spec(backend, qk_norm=spec.qk_norm)
    sparse = make_layer_spec(backend, qk_norm=spec.qk_norm, num_experts=spec.num_experts) if spec.is_moe else None
    first = layer_offset(spec, pp=pp, pp_rank=pp_rank)
    layers = range(first, first + spec.num_layers // pp)
    return TransformerBlockSubmodules(
        layer_specs=[sparse if spec.is_moe_layer(i) else dense for i in layers], layer_norm=LayerNormImpl
    )


def build_gpt_model(
    spec: ModelSpec,
    *,
    tp: int,
    pp: int = 1,
    ep: int = 1,
    moe_aux_loss_coeff: float | None = None,
    moe_routing_replay: bool = False,
    params_dtype: torch.dtype = torch.float32,
    attention_backend: str = "sdpa",
    recompute: dict[str, Any] | None = None,
):
    """A GPTModel for this rank's TP shard, pipeline stage and (MoE) EP rank's experts.

    ``attention_backend`` is a resolved backend of ``asyncrl.actor.layer_spec`` (``te``, ``sdpa`` or
    ``unfused``; feed the model with ``spec.model_inputs``); ``recompute`` holds TransformerConfig
    keywords from ``spec.recompute_settings``; ``ep`` and ``moe_*`` go to ``moe_settings``.

    Needs ``initialize_model_parallel``. At PP > 1 the stage holds layers
    ``[layer_offset, layer_offset + num_layers / pp)`` (named ``decoder.layers.<local index>``), the
    embedding on the first stage, the final norm and output layer on the last. Tied embeddings at
    PP > 1 are handled as Megatron does: the last stage holds a copy of the word embeddings as its
    ``output_layer.weight`` (``shared=True``, so the grad norm counts it once), made equal at
    construction and kept equal by the embedding-group gradient all-reduce in
    ``finalize_model_grads``.
    """
    from megatron.core.models.gpt import GPTModel

    check_parallel_sizes(spec, tp=tp, pp=pp, ep=ep)
    moe_opts = {"ep": ep, "aux_loss_coeff": moe_aux_loss_coeff, "routing_replay": moe_routing_replay}
    moe = moe_settings(spec, grouped_gemm=attention_backend == "te", **moe_opts)
    if spec.is_moe:
        bind_router_gemm_fallback()  # a GPU without TransformerEngine needs it too
    cfg = transformer_config(spec, tp=tp, pp=pp, params_dtype=params_dtype, **moe, **(recompute or {}))
    pre_process = post_process = True
    pp_rank = 0
    build = contextlib.nullcontext()
    if pp > 1:
        from megatron.core import parallel_state as ps

        pre_process, post_process = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        pp_rank = ps.get_pipeline_model_parallel_rank()
        # tied embeddings: Megatron moves the last stage's copy with `.data.cuda()` and all-reduces it
        build = cuda_as_cpu()
    with build:
        model = GPTModel(
            config=cfg,
            transformer_layer_spec=decoder_block_spec(spec, attention_backend, pp=pp, pp_rank=pp_rank),
            vocab_size=padded_vocab_size(spec.vocab_size, tp),
            max_sequence_length=spec.max_position_embeddings,
            pre_process=pre_process,
            post_process=post_process,
            parallel_output=True,
            share_embeddings_and_output_weights=spec.tie_word_embeddings,
            position_embedding_type="rope",
            rotary_base=int(spec.rope_theta) if float(spec.rope_theta).is_integer() else spec.rope_theta,
        )
    _mark_tensor_parallel_params(model)
    return model


def _mark_tensor_parallel_params(model: torch.nn.Module) -> None:
    """Set ``tensor_model_parallel``/``partition_dim`` on the sharded weights.

    megatron-core 0.16.1 sets these only inside its weight-init helpers, which
    ``perform_initialization=False`` skips; without them the grad norm (and clipping) would ignore
    the other TP ranks' shards as "duplicates".
    """
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for name, param in model.named_parameters():
        dim = tp_split_dim(canonical_megatron_name(name))
        if dim is not None and not getattr(param, "tensor_model_parallel", False):
            set_tensor_model_parallel_attributes(param, True, dim, 1)
