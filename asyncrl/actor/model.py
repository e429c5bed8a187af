"""Build a megatron-core GPTModel from a HF ``config.json`` (Qwen2/Qwen2.5, Qwen3, Llama).

Pure description first (``actor_spec``: the one ``asyncrl.models.spec.ModelSpec``, refused where the actor
cannot run it, no torch.distributed), then ``build_gpt_model`` which needs Megatron's model-parallel state
to be initialised.

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
from asyncrl.cluster.megatron_cpu import cuda_as_cpu
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


def check_parallel_sizes(spec: ModelSpec, *, tp: int, pp: int) -> None:
    """Raise ValueError naming the setting when the model cannot be split this way."""
    key = "actor.tensor_model_parallel_size"
    if spec.num_attention_heads % tp:
        raise ValueError(f"{key}={tp} must divide num_attention_heads={spec.num_attention_heads}")
    if spec.num_query_groups % tp:
        raise ValueError(f"{key}={tp} must divide num_key_value_heads={spec.num_query_groups}")
    if spec.ffn_hidden_size % tp:
        raise ValueError(f"{key}={tp} must divide intermediate_size={spec.ffn_hidden_size}")
    if pp < 1 or spec.num_layers % pp:
        raise ValueError(
            f"actor.pipeline_model_parallel_size={pp} must divide num_hidden_layers={spec.num_layers} "
            "(the layers are split evenly over the pipeline stages)"
        )


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


def build_gpt_model(
    spec: ModelSpec,
    *,
    tp: int,
    pp: int = 1,
    params_dtype: torch.dtype = torch.float32,
    attention_backend: str = "sdpa",
    recompute: dict[str, Any] | None = None,
):
    """A GPTModel for this rank's TP shard and pipeline stage.

    ``attention_backend`` is a resolved backend of ``asyncrl.actor.layer_spec`` (``te``, ``sdpa`` or
    ``unfused``; feed the model with ``spec.model_inputs``); ``recompute`` holds TransformerConfig
    keywords from ``spec.recompute_settings``.

    Needs ``initialize_model_parallel``. At PP > 1 the stage holds layers
    ``[layer_offset, layer_offset + num_layers / pp)`` (named ``decoder.layers.<local index>``), the
    embedding on the first stage, the final norm and output layer on the last. Tied embeddings at
    PP > 1 are handled as Megatron does: the last stage holds a copy of the word embeddings as its
    ``output_layer.weight`` (``shared=True``, so the grad norm counts it once), made equal at
    construction and kept equal by the embedding-group gradient all-reduce in
    ``finalize_model_grads``.
    """
    from megatron.core.models.gpt import GPTModel

    check_parallel_sizes(spec, tp=tp, pp=pp)
    cfg = transformer_config(spec, tp=tp, pp=pp, params_dtype=params_dtype, **(recompute or {}))
    layer_spec = make_layer_spec(attention_backend, qk_norm=spec.qk_norm)
    pre_process = post_process = True
    build = contextlib.nullcontext()
    if pp > 1:
        from megatron.core import parallel_state as ps

        pre_process, post_process = ps.is_pipeline_first_stage(), ps.is_pipeline_last_stage()
        # tied embeddings: Megatron moves the last stage's copy with `.data.cuda()` and all-reduces it
        build = cuda_as_cpu()
    with build:
        model = GPTModel(
            config=cfg,
            transformer_layer_spec=layer_spec,
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
