"""A trainable plain-PyTorch decoder with HF parameter names (Qwen2 / Qwen3 / Llama / Qwen3-MoE).

Used for the embedded default's supervised warm start (one process, before the Megatron world
exists: ``hidden_states_buckets`` runs a batch's rows after their shared prompt prefix, in buckets of similar
lengths), by ``benchmarks/weight_sync_bench.py`` and by tests as a trainer with HF names. Its
``state_dict()`` keys are exactly the HF checkpoint's, so ``load_hf``/``save_hf`` round-trip
``model.safetensors`` and the CPU engine and the actor load the result unchanged. The architecture is
``asyncrl.models.spec.ModelSpec`` (refused as ``TORCH_DECODER`` refuses it), RoPE ``asyncrl.models.rope``
(the CPU engine's angles), the weights go through ``asyncrl.models.safetensors_io``.

    model = TorchDecoder.from_pretrained("runs/tiny/model")
    logits_BTV = model(ids_BT)
    model.save_pretrained("runs/tiny/model_sft", copy_from="runs/tiny/model")
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from asyncrl.models.rope import rope_inv_freq
from asyncrl.models.routing import route
from asyncrl.models.safetensors_io import SafetensorsReader, save_safetensors
from asyncrl.models.spec import TORCH_DECODER, ModelSpec, load_hf_config, require


class _RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class _Attention(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        h, nh, nkv, d = s.hidden_size, s.num_attention_heads, s.num_query_groups, s.head_dim
        self.nh, self.nkv, self.d = nh, nkv, d
        self.q_proj = nn.Linear(h, nh * d, bias=s.qkv_bias)
        self.k_proj = nn.Linear(h, nkv * d, bias=s.qkv_bias)
        self.v_proj = nn.Linear(h, nkv * d, bias=s.qkv_bias)
        self.o_proj = nn.Linear(nh * d, h, bias=s.o_bias)
        if s.qk_norm:
            self.q_norm = _RMSNorm(d, s.rms_norm_eps)
            self.k_norm = _RMSNorm(d, s.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(self, x, cos, sin, kv_out=None):
        """Causal self-attention of ``x`` ``[B, T, H]`` (``cos``/``sin`` ``[T, 1, d]``). ``kv_out`` collects this
        call's keys/values (``[1, nkv, T, d]`` of a shared prefix: ``forward_buckets``' ``prefix_kv``)."""
        q, k, v = self._rotated(x, cos, sin)
        return self.o_proj(self._attend(q, k, v, kv_out=kv_out))

    def forward_buckets(self, x_NH, buckets, prefix_kv):
        """Attention of rows laid out flat: ``x_NH`` is the buckets' ``[B, S]`` rows back to back (``_Buckets``:
        their rotary angles ``[N, 1, d]`` and masks); each bucket attends on its own."""
        q, k, v = self._rotated(x_NH, buckets.cos, buckets.sin)
        outs = [
            self._attend(
                q_b.view(B, S, self.nh, self.d),
                k_b.view(B, S, self.nkv, self.d),
                v_b.view(B, S, self.nkv, self.d),
                prefix_kv=prefix_kv,
                mask=mask,
            ).view(B * S, -1)
            for (B, S), mask, q_b, k_b, v_b in zip(
                buckets.shapes, buckets.masks, q.split(buckets.sizes), k.split(buckets.sizes), v.split(buckets.sizes)
            )
        ]
        return self.o_proj(torch.cat(outs))

    def _rotated(self, x, cos, sin):
        """``x`` ``[..., H]`` -> q ``[..., nh, d]``, k and v ``[..., nkv, d]``, q and k normed (Qwen3) and rotated."""
        # one matmul for q, k and v (the HF parameters stay separate: same values, fewer passes over x)
        projs = (self.q_proj, self.k_proj, self.v_proj)
        bias = torch.cat([m.bias for m in projs]) if self.q_proj.bias is not None else None
        qkv = F.linear(x, torch.cat([m.weight for m in projs]), bias)
        qk, v = qkv.split(((self.nh + self.nkv) * self.d, self.nkv * self.d), dim=-1)
        qk = qk.unflatten(-1, (self.nh + self.nkv, self.d))
        if self.q_norm is not None:
            q, k = qk.split((self.nh, self.nkv), dim=-2)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=-2)
        q, k = _rope(qk, cos, sin).split((self.nh, self.nkv), dim=-2)  # q and k rotated in one pass
        return q, k, v.unflatten(-1, (self.nkv, self.d))

    def _attend(self, q, k, v, *, prefix_kv=None, kv_out=None, mask=None):
        """``q`` ``[B, T, nh, d]``, ``k``/``v`` ``[B, T, nkv, d]`` -> attention output ``[B, T, nh d]``: causal, or
        with ``prefix_kv`` (keys/values ``[1, nkv, P, d]`` shared by every row) under ``mask`` (``[T, P + T]``,
        0.0 = attend, -inf = not)."""
        B, T = q.shape[:2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if kv_out is not None:
            kv_out.append((k, v))
        gqa = self.nh != self.nkv
        if prefix_kv is None:
            out = _attention_fp32(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            pk, pv = prefix_kv
            k = torch.cat((pk.expand(B, -1, -1, -1), k), dim=2)
            v = torch.cat((pv.expand(B, -1, -1, -1), v), dim=2)
            out = _attention_fp32(q, k, v, attn_mask=mask, enable_gqa=gqa)
        return out.transpose(1, 2).reshape(B, T, self.nh * self.d)


def _attention_fp32(q, k, v, **kw):
    """SDPA in float32 even under autocast (which would run it in bfloat16): on CPU, with this model's
    32-wide heads, bfloat16 attention is slower than float32 (measured), and float32 keeps its softmax exact.
    Without autocast this is plain SDPA (the casts are no-ops)."""
    with torch.autocast(q.device.type, enabled=False):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw)


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def _angles(inv_freq: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary cos and sin ``[*positions.shape, 1, d]`` (broadcast over heads) of integer ``positions``."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos()[..., None, :], emb.sin()[..., None, :]


class _Buckets:
    """The per-bucket inputs of ``TorchDecoder.hidden_states_buckets``, made once for every layer: each bucket's
    shape ``(B, S)`` and token count, the rotary angles of every token (``[N, 1, d]``, positions ``P .. P + S - 1``
    in each row) and each bucket's additive mask ``[S, P + S]``
    (the prefix open, causal after it; float, because CPU SDPA turns a bool mask into one per call and runs
    ~8% slower with it, measured)."""

    def __init__(self, inv_freq: torch.Tensor, P: int, shapes: list[tuple[int, int]]):
        self.shapes = shapes
        self.sizes = [B * S for B, S in shapes]
        self.cos, self.sin = _angles(inv_freq, torch.cat([torch.arange(P, P + S).repeat(B) for B, S in shapes]))
        self.masks = []
        for _, S in shapes:
            allowed = torch.ones(S, P + S, dtype=torch.bool).tril(P)
            self.masks.append(torch.zeros(S, P + S).masked_fill_(~allowed, float("-inf")))


class _MLP(nn.Module):
    def __init__(self, h: int, f: int):
        super().__init__()
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x):
        gate, up = F.linear(x, torch.cat((self.gate_proj.weight, self.up_proj.weight))).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class _SparseMoE(nn.Module):
    """Qwen3-MoE's expert MLP: the router ``gate`` scores every expert (softmax in float32), each token goes to its
    top-k experts (their probabilities renormalised to sum to 1 when ``norm_topk_prob``) and gets their outputs
    weighted by those probabilities. Each expert runs once, on the tokens routed to it."""

    def __init__(self, s: ModelSpec):
        super().__init__()
        self.gate = nn.Linear(s.hidden_size, s.num_experts, bias=False)
        self.experts = nn.ModuleList(_MLP(s.hidden_size, s.moe_ffn_hidden_size) for _ in range(s.num_experts))
        self.top_k, self.renormalize = s.num_experts_per_tok, s.norm_topk_prob

    def forward(self, x):
        flat = x.reshape(-1, x.shape[-1])
        weight, chosen = route(flat, self.gate.weight, self.top_k, renormalize=self.renormalize)
        weight = weight.to(flat.dtype)
        out = torch.zeros_like(flat)
        for e, expert in enumerate(self.experts):
            rows, slot = (chosen == e).nonzero(as_tuple=True)  # an expert without tokens still runs (on none):
            out = out.index_add(
                0, rows, expert(flat[rows]) * weight[rows, slot, None]
            )  # its gradient is zero, not None
        return out.view_as(x)


class _Layer(nn.Module):
    def __init__(self, s: ModelSpec, index: int):
        super().__init__()
        self.input_layernorm = _RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = _Attention(s)
        self.post_attention_layernorm = _RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = _SparseMoE(s) if s.is_moe_layer(index) else _MLP(s.hidden_size, s.ffn_hidden_size)

    def forward(self, x, cos, sin, kv_out=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, kv_out)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_buckets(self, x_NH, buckets, prefix_kv):
        x_NH = x_NH + self.self_attn.forward_buckets(self.input_layernorm(x_NH), buckets, prefix_kv)
        return x_NH + self.mlp(self.post_attention_layernorm(x_NH))


class _Body(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(_Layer(s, i) for i in range(s.num_layers))
        self.norm = _RMSNorm(s.hidden_size, s.rms_norm_eps)


class TorchDecoder(nn.Module):
    def __init__(self, config: dict, *, where: str = "config.json"):
        """``config``: a HF ``config.json`` dict (``where``: its path, for the errors)."""
        super().__init__()
        self.config = config
        self.spec = spec = require(ModelSpec.from_hf_config(config, where=where), TORCH_DECODER)
        self.model = _Body(spec)
        self.tied = spec.tie_word_embeddings
        self.lm_head = None if self.tied else nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        self.register_buffer("inv_freq", rope_inv_freq(spec), persistent=False)

    def forward(self, ids_BT: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, T, V]``."""
        return self.lm_logits(self.hidden_states(ids_BT))

    def lm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits of (any selection of) final hidden states: lets a loss skip positions it ignores."""
        w = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return F.linear(hidden, w)

    def hidden_states(self, ids_BT: torch.Tensor) -> torch.Tensor:
        """Final-norm hidden states ``[B, T, H]``."""
        return self._run(ids_BT, offset=0)

    def hidden_states_shared_prefix(
        self, prefix_P: torch.Tensor, ids_BS: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states of rows ``prefix + ids_BS[b]`` with the common prefix computed once:
        ``([1, P, H] of the prefix, [B, S, H] of the rows' own tokens)``. Equal to
        ``hidden_states(cat(prefix, row))`` split at P; gradients flow through the prefix once. One bucket of
        ``hidden_states_buckets``."""
        h_prefix, h_NH = self.hidden_states_buckets(prefix_P, [ids_BS])
        return h_prefix, h_NH.view(*ids_BS.shape, -1)

    def hidden_states_buckets(
        self, prefix_P: torch.Tensor, buckets_BS: list[torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``hidden_states_shared_prefix`` of several buckets of rows at once: ``([1, P, H] of the prefix,
        [N, H])``, ``N`` the buckets' tokens back to back (bucket by bucket, each ``[B, S]`` row-major). The
        linear layers, norms and MLPs run once over all ``N`` tokens; attention runs per bucket, so rows of
        different lengths each pay only for their bucket's width. Rows are right-padded: a row's real tokens
        never see its padding (causal), so each row equals running ``prefix + row`` alone."""
        kvs: list = []
        P = prefix_P.shape[0]
        h_prefix = self._run(prefix_P[None], offset=0, kv_out=kvs)
        buckets = _Buckets(self.inv_freq, P, [tuple(b.shape) for b in buckets_BS])
        x = self.model.embed_tokens(torch.cat([b.reshape(-1) for b in buckets_BS]))
        for layer, kv in zip(self.model.layers, kvs):
            x = layer.forward_buckets(x, buckets, kv)
        return h_prefix, self.model.norm(x)

    def _run(
        self,
        ids_BT: torch.Tensor,
        *,
        offset: int,
        kv_out: list | None = None,
    ) -> torch.Tensor:
        cos, sin = _angles(self.inv_freq, torch.arange(offset, offset + ids_BT.shape[1]))
        x = self.model.embed_tokens(ids_BT)
        for layer in self.model.layers:
            x = layer(x, cos, sin, kv_out)
        return self.model.norm(x)

    @classmethod
    def from_pretrained(cls, path: str | Path) -> TorchDecoder:
        root = Path(path)
        model = cls(load_hf_config(root), where=str(root / "config.json"))
        state = SafetensorsReader(root).to_dict()
        if model.tied:
            state.pop("lm_head.weight", None)
        missing, unexpected = model.load_state_dict({k: v.float() for k, v in state.items()}, strict=False)
        if missing or unexpected:
            raise ValueError(
                f"{root}: checkpoint does not match config.json (missing {missing[:5]}, unexpected {unexpected[:5]})"
            )
        return model

    def save_pretrained(self, out: str | Path, *, copy_from: str | Path) -> Path:
        """Write model.safetensors into ``out`` and copy config/tokenizer files from ``copy_from``."""
        out, src = Path(out), Path(copy_from)
        out.mkdir(parents=True, exist_ok=True)
        for f in src.iterdir():
            if f.is_file() and f.suffix != ".safetensors":
                shutil.copy2(f, out / f.name)
        state = {k: v.detach().contiguous() for k, v in self.state_dict().items()}
        save_safetensors(state, out / "model.safetensors")
        return out
