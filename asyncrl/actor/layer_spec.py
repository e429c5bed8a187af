"""The actor's transformer layer: which attention runs, how packed batches reach it, recompute.

The one place that decides how the Megatron GPTModel attends. Importable without CUDA, without
TransformerEngine and without megatron-core (those are imported inside the functions that need them).

Contract
- ``resolve_attention(requested, *, cuda, te_available)`` (pure): ``actor.attention_backend`` ->
  ``"te"`` | ``"sdpa"`` | ``"unfused"``. ``auto`` is TransformerEngine on CUDA when
  ``transformer_engine`` imports, else ``sdpa``. ``te`` without CUDA or without TE is a ValueError
  naming the key.
- ``layer_spec(backend, qk_norm=, num_experts=None)``: Megatron's TE layer spec (``te``); the local layer spec
  with ``FusedCoreAttention`` as its core attention (``sdpa``); the plain local spec, whose
  ``DotProductAttention`` materializes the ``[b, heads, S, S]`` probabilities (``unfused``: kept as
  the CPU reference the fused path is tested against). With ``num_experts`` the layer's MLP is
  megatron-core's MoE layer: TE's grouped-GEMM experts (``TEGroupedMLP``) with ``te``, the local
  ``SequentialMLP`` (one MLP per expert) otherwise; its pre-MLP norm is its own module in both.
- ``model_inputs(packed, backend)``: the GPTModel call for a ``PackedBatch``. Fused backends get
  the ``thd`` layout: the ``[R, C]`` rows flattened to one ``[1, R*C]`` row plus a
  ``PackedSeqParams(qkv_format="thd")`` whose ``cu_seqlens`` are the batch's segments (each
  sequence, each padding run): attention never crosses a segment and no ``S x S`` tensor exists.
  ``unfused`` gets the ``[R, C]`` rows and the dense block-diagonal mask. Either way the logits
  flatten to ``R*C`` positions in the same order, so ``PackedBatch.pred_index`` holds. A batch with padding
  also passes it as megatron-core's ``padding_mask`` (in the layout of ``input_ids``; MoE layers leave those
  positions out of their load-balancing loss, dense layers ignore it).
  ``response_logits(model, packed, backend, filler=)``: that call with the output layer fed only the positions that
  predict response tokens: ``[T, V_local]`` logits in ``pred_index`` order (the other positions' logits are never
  computed). A ``filler`` micro-batch (nothing trained: it only keeps an EP group's MoE collectives in step,
  ``asyncrl.actor.moe``) runs in eval mode: its routers attach no load-balancing loss and record nothing.
  ``pack_microbatch(seqs, prompt_lens, backend)``: one micro-batch packed for the backend at PP = 1: fused
  backends one row of every sequence, no padding (``[1, T]``); ``unfused`` rows of the longest sequence.
  ``p2p_shape(rows, row_len, backend)``: the matching ``(seq_length, micro_batch_size)`` of the
  activations the pipeline schedule sends between stages.
- ``FusedCoreAttention``: a drop-in for megatron-core 0.16.1's ``DotProductAttention``
  (same constructor keywords, same ``forward(query, key, value, attention_mask, *,
  attn_mask_type, attention_bias, packed_seq_params)``). ``thd``: per segment, causal
  ``scaled_dot_product_attention`` (flash/efficient kernels on CUDA, torch's CPU flash kernel on CPU: 4-D inputs), or torch's
  variable-length flash attention on CUDA in bf16/fp16 when this torch has it. ``sbhd`` with a
  mask: SDPA with that boolean mask (True = masked out); without a mask: causal SDPA.
- ``recompute_settings(granularity, method, num_layers, layers_per_stage=)`` (pure): the
  ``actor.recompute_*`` keys as megatron-core ``TransformerConfig`` keywords.
- ``attention_path(backend, dtype=, device=)``: a label of the kernel in use, for reports
  (``te``, ``varlen-flash``, ``sdpa-flash``, ``sdpa-efficient``, ``sdpa-flash-cpu``, ``unfused``).

Example::

    backend = resolve_attention(cfg.actor.attention_backend, cuda=torch.cuda.is_available(),
                                te_available=te_available())
    model = build_gpt_model(spec, tp=1, attention_backend=backend)  # asyncrl.actor.model
    logits = response_logits(model, packed, backend)  # [T, V]: the positions predicting response tokens
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import math
from typing import Any

import torch
import torch.nn.functional as F

from asyncrl.actor.batch import PackedBatch, pack
from asyncrl.actor.moe import replay_routing

# Lazy imports here: megatron-core (and transformer_engine, an optional GPU package) is imported inside the functions that use it; its import takes seconds
# and probes CUDA, and this module's pure parts (and --dry-run, the tests of them) must import without it.

BACKENDS = ("auto", "te", "sdpa", "unfused")
FUSED = ("te", "sdpa")


@functools.cache
def te_available() -> bool:
    """Whether TransformerEngine's PyTorch package imports (a GPU build is installed)."""
    if importlib.util.find_spec("transformer_engine") is None:
        return False
    try:
        import transformer_engine.pytorch  # noqa: F401
    except (ImportError, OSError, RuntimeError):  # a TE wheel without its CUDA libraries
        return False
    return True


def resolve_attention(requested: str, *, cuda: bool, te_available: bool) -> str:
    key = "actor.attention_backend"
    if requested not in BACKENDS:
        raise ValueError(f"{key}: must be one of {BACKENDS}, got {requested!r}")
    if requested == "auto":
        return "te" if (cuda and te_available) else "sdpa"
    if requested == "te" and not (cuda and te_available):
        raise ValueError(
            f"{key} = 'te' needs CUDA and an importable transformer_engine "
            f"(cuda={cuda}, transformer_engine={te_available}); use 'auto' or 'sdpa'"
        )
    return requested


def layer_spec(backend: str, *, qk_norm: bool, num_experts: int | None = None):
    from megatron.core.models.gpt import gpt_layer_specs as specs

    if backend == "te":
        return specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=num_experts, moe_grouped_gemm=num_experts is not None, qk_layernorm=qk_norm
        )
    spec = specs.get_gpt_layer_local_spec(num_experts=num_experts, qk_layernorm=qk_norm, normalization="RMSNorm")
    if backend == "sdpa":
        spec.submodules.self_attention.submodules.core_attention = FusedCoreAttention
    else:
        assert backend == "unfused", backend
    return spec


def pack_microbatch(seqs, prompt_lens, backend: str) -> PackedBatch:
    """One micro-batch packed for ``backend`` (PP = 1; see the contract): fused backends get every sequence in
    one row, without padding (``thd`` attends segment by segment, so rows would only add padding tokens that
    every linear layer, norm and the output layer compute); ``unfused`` gets rows of the longest sequence
    (its dense mask is ``[R, 1, C, C]``)."""
    if backend in FUSED:
        return pack(seqs, prompt_lens, row_len=sum(len(s) for s in seqs))
    return pack(seqs, prompt_lens)


def model_inputs(packed: PackedBatch, backend: str) -> tuple[tuple, dict[str, Any]]:
    """``(args, kwargs)`` of the GPTModel call for one packed micro-batch (see the contract)."""
    pad = {} if packed.padding is None else {"padding_mask": packed.padding}
    if backend not in FUSED:
        return (packed.input_ids, packed.position_ids, packed.attention_mask), pad
    from megatron.core.packed_seq_params import PackedSeqParams

    cu = packed.cu_seqlens.to(device=packed.input_ids.device, dtype=torch.int32)
    params = PackedSeqParams(
        qkv_format="thd",
        cu_seqlens_q=cu,
        cu_seqlens_kv=cu,
        max_seqlen_q=packed.max_seqlen,
        max_seqlen_kv=packed.max_seqlen,
    )
    args = (packed.input_ids.reshape(1, -1), packed.position_ids.reshape(1, -1), None)
    pad = {k: v.reshape(1, -1) for k, v in pad.items()}
    return args, {"packed_seq_params": params, **pad}


def response_logits(model: torch.nn.Module, packed: PackedBatch, backend: str, *, filler: bool = False) -> torch.Tensor:
    """The model called on ``packed`` (``model_inputs``), its output layer fed only the hidden states of the
    positions that predict the response tokens: ``[T, V_local]`` logits in ``packed.pred_index`` order. A model
    without an output layer (a pipeline stage before the last) returns its activations unchanged. ``model``
    may be wrapped (Megatron's DDP: ``.module``). ``filler``: in eval mode (see the contract). The routers replay
    ``packed.routed`` where they replay (``asyncrl.actor.moe.replay_routing``)."""
    args, kwargs = model_inputs(packed, backend)
    inner = model
    while not hasattr(inner, "output_layer") and hasattr(inner, "module"):
        inner = inner.module
    head = getattr(inner, "output_layer", None)
    index = packed.pred_index

    def select(_module, inputs):
        hidden = inputs[0]  # [s, b, h]; flattened as [b, s] so that pred_index addresses it
        picked = hidden.transpose(0, 1).reshape(-1, hidden.shape[-1]).index_select(0, index)
        return (picked.unsqueeze(1), *inputs[1:])

    routed = packed.routed  # [R, C, width]; the router flattens its tokens as [s, b] (``model_inputs``)
    if routed is not None:
        routed = (routed if backend in FUSED else routed.transpose(0, 1)).reshape(-1, routed.shape[-1])
    replay_routing(model, routed)
    handle = None if head is None else head.register_forward_pre_hook(select)
    training = model.training
    if filler:
        model.eval()
    try:
        out = model(*args, **kwargs)  # [1, T, V_local] (the activations on a stage before the last)
    finally:
        if filler:
            model.train(training)
        if handle is not None:
            handle.remove()
    return out if head is None else out.reshape(-1, out.shape[-1])


def p2p_shape(rows: int, row_len: int, backend: str) -> tuple[int, int]:
    """``(seq_length, micro_batch_size)`` of a ``[rows, row_len]`` micro-batch inside the model."""
    return (rows * row_len, 1) if backend in FUSED else (row_len, rows)


def recompute_settings(
    granularity: str, method: str | None, num_layers: int | None, *, layers_per_stage: int
) -> dict[str, Any]:
    """``actor.recompute_*`` -> TransformerConfig keywords (``{}`` when recompute is off).

    ``full``: every ``num_layers`` (default 1) layers are one checkpointed unit (``uniform``,
    the default) or the first ``num_layers`` layers of each stage are checkpointed (``block``).
    ``selective``: Megatron's default selective modules (core attention).
    """
    if granularity == "none":
        return {}
    if granularity == "selective":
        return {"recompute_granularity": "selective"}
    assert granularity == "full", granularity
    n = 1 if num_layers is None else num_layers
    if not 1 <= n <= layers_per_stage:
        raise ValueError(
            f"actor.recompute_num_layers = {n} must be between 1 and the {layers_per_stage} layers of a pipeline stage"
        )
    return {"recompute_granularity": "full", "recompute_method": method or "uniform", "recompute_num_layers": n}


def attention_path(backend: str, *, dtype: torch.dtype, device: torch.device | str) -> str:
    if backend != "sdpa":
        return backend
    dev = torch.device(device)
    if dev.type != "cuda":
        return "sdpa-flash-cpu"  # 4-D inputs: torch's CPU flash kernel (tests/unit/test_actor_spec.py checks it runs)
    if _varlen_fn() is not None and dtype in (torch.float16, torch.bfloat16):
        return "varlen-flash"
    if dtype in (torch.float16, torch.bfloat16) and torch.backends.cuda.flash_sdp_enabled():
        return "sdpa-flash"
    return "sdpa-efficient"


@functools.cache
def _varlen_fn():
    """``(varlen_attn with causality bound, takes enable_gqa)`` for this torch, or None.

    torch's variable-length flash attention has changed its keywords between releases (``is_causal``,
    then ``window_size``); a torch whose version asks for neither, or cannot take ``scale``, is not used.
    """
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    if "scale" not in params:
        return None
    return functools.partial(varlen_attn, **causal), "enable_gqa" in params


def _segment_lengths(params) -> list[int]:
    cu = params.cu_seqlens_q
    return (cu[1:] - cu[:-1]).tolist()


class FusedCoreAttention(torch.nn.Module):
    """Core attention on ``scaled_dot_product_attention``; see the module contract.

    Inputs as megatron-core gives them: ``sbhd`` ``query [sq, b, heads, d]``, ``key``/``value``
    ``[sk, b, groups, d]``; ``thd`` ``[t, heads, d]`` / ``[t, groups, d]``. Output ``[sq, b, heads*d]``
    (``thd``: ``[t, heads*d]``).
    """

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ):
        super().__init__()
        if config.context_parallel_size != 1:
            raise ValueError("FusedCoreAttention does not support context parallelism")
        if getattr(config, "softmax_type", "vanilla") != "vanilla":
            raise ValueError(f"FusedCoreAttention supports softmax_type 'vanilla', got {config.softmax_type!r}")
        self.config = config
        self.attn_mask_type = attn_mask_type
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(config.kv_channels)
        if config.apply_query_key_layer_scaling:
            self.softmax_scale /= max(1, layer_number)
        self.dropout_p = config.attention_dropout if attention_dropout is None else attention_dropout

    def forward(
        self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None, packed_seq_params=None
    ):
        if attention_bias is not None:
            raise ValueError("FusedCoreAttention: attention_bias is not supported")
        p = self.dropout_p if self.training else 0.0
        if packed_seq_params is not None:
            if packed_seq_params.qkv_format != "thd":
                raise ValueError(f"FusedCoreAttention: packed qkv_format {packed_seq_params.qkv_format!r}")
            return self._thd(query, key, value, params=packed_seq_params, p=p)
        q, k, v = (x.permute(1, 2, 0, 3) for x in (query, key, value))  # [b, heads, s, d]
        gqa = q.shape[1] != k.shape[1]
        if attention_mask is None:
            out = F.scaled_dot_product_attention(
                q, k, v, dropout_p=p, is_causal=True, scale=self.softmax_scale, enable_gqa=gqa
            )
        else:
            out = F.scaled_dot_product_attention(
                q, k, v, attn_mask=~attention_mask, dropout_p=p, scale=self.softmax_scale, enable_gqa=gqa
            )
        sq, b = query.shape[0], query.shape[1]
        return out.permute(2, 0, 1, 3).reshape(sq, b, -1)

    def _thd(self, query, key, value, *, params, p: float):
        varlen = _varlen_fn()
        use_varlen = (
            varlen is not None and query.is_cuda and query.dtype in (torch.float16, torch.bfloat16) and p == 0.0
        )
        if use_varlen:
            fn, has_gqa = varlen
            if query.shape[1] != key.shape[1] and not has_gqa:
                rep = query.shape[1] // key.shape[1]
                key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
            kw = {"enable_gqa": True} if has_gqa and query.shape[1] != key.shape[1] else {}
            cu = params.cu_seqlens_q
            q, k, v = (x.contiguous() for x in (query, key, value))  # v is a strided view of the fused qkv
            out = fn(q, k, v, cu, cu, params.max_seqlen_q, params.max_seqlen_q, scale=self.softmax_scale, **kw)
            return out.reshape(query.shape[0], -1)
        gqa = query.shape[1] != key.shape[1]
        lens = _segment_lengths(params)
        # [1, heads, t, d] views split along t, not [heads, s, d] per segment: torch's CPU flash kernel takes
        # 4-D inputs only (3-D ones fall back to the math kernel, ~1.5x slower with its backward), and one
        # transpose of the whole batch (not one per segment and tensor) keeps the autograd graph short.
        qs, ks, vs = (torch.split(x.transpose(0, 1).unsqueeze(0), lens, dim=2) for x in (query, key, value))
        outs = [
            F.scaled_dot_product_attention(
                q, k, v, dropout_p=p, is_causal=True, scale=self.softmax_scale, enable_gqa=gqa
            ).transpose(1, 2)  # [1, s, heads, d]
            for q, k, v in zip(qs, ks, vs)
        ]
        return torch.cat(outs, dim=1).reshape(query.shape[0], -1)
