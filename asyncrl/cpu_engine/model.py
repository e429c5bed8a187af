"""A small fp32 torch implementation of the HF Qwen2 / Qwen3 / Llama decoder and of Qwen3-MoE, for the CPU engine.

Contract
- ``load_model(path)`` reads ``config.json`` (+ ``generation_config.json``) and the safetensors
  (single file or sharded with ``model.safetensors.index.json``); parameters keep their HF names
  (``model.layers.3.self_attn.q_proj.weight``) so the weight sync can address them directly.
- Parameters live in fused buffers (qkv, gate_up) and the HF-named tensors are *views* into them,
  so ``model.load_weights([(name, tensor)])`` copies straight into what the forward uses.
- Qwen3-MoE: a sparse layer (``spec.is_moe_layer``) has the router ``mlp.gate.weight`` [E, H] and per-expert
  ``mlp.experts.<e>.{gate,up,down}_proj.weight`` (HF's names), views into two [E, ...] buffers; its MLP is HF's
  (``experts``: fp32 softmax, top-k, renormalised when ``norm_topk_prob``; the sum of the chosen SwiGLU experts,
  weighted), the tokens grouped per expert (one pair of matrix products per expert hit, never a loop per token).
  Dense layers of the same model keep ``mlp.{gate,up,down}_proj`` of width ``intermediate_size``.
- Routing capture (SGLang's ``--enable-return-routed-experts``): a ``KVPool(..., routing=True)`` (``kv_pool``) also
  keeps, beside each cached token, the experts it was routed to in each layer (``kv.routed``), written by every
  forward; with it, the last layer runs for every token (``last_only`` still returns each request's last token).
- ``model.forward(tokens_T, past_len_B, new_len_B, kv, row0=row0)`` runs a packed batch of requests whose
  KV lives in rows ``row0 .. row0+B-1`` of a ``KVPool``: request b has ``past_len_B[b]`` cached
  tokens and ``new_len_B[b]`` new ones, and ``tokens_T`` holds every request's new tokens back to back
  (T = sum of new_len_B, no padding). Decode rows (one new token) and prefills or continuations after a
  prefix hit (several) mix in one call, as SGLang's mixed batches: every linear layer runs once over the
  T tokens; attention takes the leading one-token rows as one batched query each and the rest as a
  padded block. Returns hidden states [T, H] (``last_only=True``: [B, H], each request's last token, the last
  layer run for those alone); ``model.logits`` maps them to the vocabulary.

    model = load_model("runs/tiny/model")
    kv = KVPool(model.spec, max_rows=8)
    h = model.forward(torch.tensor([5, 6, 7]), torch.tensor([0]), torch.tensor([3]), kv, row0=0)
    logits_V = model.logits(h[-1])
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open

from asyncrl.cpu_engine.experts import experts_mlp
from asyncrl.cpu_engine.kv_pool import KVPool
from asyncrl.models.rope import rope_inv_freq
from asyncrl.models.routing import route
from asyncrl.models.safetensors_io import SafetensorsReader
from asyncrl.models.spec import CPU_ENGINE, ModelSpec, require


def _rotate_half_matrix(d: int) -> torch.Tensor:
    """R [d, d] with ``x @ R == cat(-x[d/2:], x[:d/2])`` exactly (one +-1 per column): HF's rotate-half as one
    matmul instead of two slices, a negation and a concatenation."""
    half = d // 2
    r = torch.zeros(d, d)
    r[torch.arange(half) + half, torch.arange(half)] = -1.0
    r[torch.arange(half), torch.arange(half) + half] = 1.0
    return r


def _hidden_bias(hidden: torch.Tensor) -> torch.Tensor:
    """An additive attention mask: -inf where ``hidden`` (bool), 0 elsewhere."""
    return torch.zeros(hidden.shape).masked_fill_(hidden, float("-inf"))


@dataclass(frozen=True)
class _Padded:
    """The rows after the decode rows, attended as a padded [rows, longest feed] block."""

    b_idx: torch.Tensor
    j_idx: torch.Tensor
    """(row among these rows, position in its feed) of each of their tokens, in packed order."""
    bias: torch.Tensor
    """[rows, 1, grp * N, L] float: 0 where a query (grp query heads of a kv head, then N positions) sees a key,
    -inf where it does not (SDPA's additive mask, built once per forward: a bool mask is converted every layer)."""
    N: int
    L: int


@dataclass(frozen=True)
class _Plan:
    """One forward's shared tables (``CausalLM._plan``)."""

    cos: torch.Tensor
    sin: torch.Tensor
    """[T, q + k + v heads, head_dim] each: the rotary tables of q heads (times the attention scale, so scores
    need no scaling) and k heads; 1 and 0 for v heads (left as they are)."""
    kv_index: torch.Tensor
    """Flat index of each token's kv heads in a layer's cache viewed as [rows * kv_heads * capacity, d]."""
    route_index: Optional[torch.Tensor]
    """Flat index of each token's slot in ``kv.routed`` viewed as [rows * capacity, layers, top-k] (None: the pool
    keeps no routing)."""
    row0: int
    num_decode: int
    """The leading rows with one new token each (tokens 0 .. num_decode-1): batched one-query attention."""
    dec_L: int
    dec_bias: torch.Tensor
    """[num_decode, 1, 1, dec_L] float: -inf where a key is hidden from a decode row's query, else 0 (added to the
    scores: a broadcast add costs a seventh of a masked fill with a broadcast bool mask)."""
    pad: Optional[_Padded]
    """The other rows (None when every row decodes)."""
    last: Optional[tuple[torch.Tensor, int, torch.Tensor]]
    """``last_only`` with a multi-token row: (index of each row's last token [B], the longest row L, [B, 1, 1, L]
    float bias of those queries: -inf on hidden keys); the last layer attends and runs its MLP for these B tokens
    only."""


class CausalLM:
    """The decoder with HF-named parameters (views into fused buffers). fp32, no autograd; ``weight_dtype``
    (SGLang's ``--dtype``): every loaded weight is rounded to it first, so the fp32 buffers hold exactly the values
    of a ``weight_dtype`` model (``t.to(weight_dtype).to(float32)`` is exact back and forth)."""

    def __init__(self, spec: ModelSpec, *, weight_dtype: torch.dtype = torch.float32):
        self.spec = spec
        self.weight_dtype = weight_dtype
        s = spec
        h = s.hidden_size
        self.params: dict[str, torch.Tensor] = {}
        # buffer -> the HF names that are views of it ("layers.3.qkv_w" -> q/k/v_proj.weight): the
        # unit ``swap_groups`` exchanges between two models of the same spec
        self.groups: dict[str, tuple[str, ...]] = {
            "embed": ("model.embed_tokens.weight",),
            "norm": ("model.norm.weight",),
        }
        self.embed = torch.zeros(s.vocab_size, h)
        self.params["model.embed_tokens.weight"] = self.embed
        self.layers: list[dict[str, torch.Tensor]] = [self._add_layer(i) for i in range(s.num_layers)]
        self.norm = torch.ones(h)
        self.params["model.norm.weight"] = self.norm
        if s.tie_word_embeddings:
            self.lm_head = self.embed
        else:
            self.lm_head = torch.zeros(s.vocab_size, h)
            self.params["lm_head.weight"] = self.lm_head
            self.groups["lm_head"] = ("lm_head.weight",)
        self.inv_freq = rope_inv_freq(spec)
        self.rot = _rotate_half_matrix(s.head_dim)
        self.group_of = {n: g for g, names in self.groups.items() for n in names}

    def _add_layer(self, i: int) -> dict[str, torch.Tensor]:
        """Layer ``i``'s fused buffers, with their HF-named views registered in ``params`` and ``groups``."""
        s = self.spec
        h, d, nh, nkv, ffn = s.hidden_size, s.head_dim, s.num_attention_heads, s.num_query_groups, s.ffn_hidden_size
        p = f"model.layers.{i}."
        L = {
            "ln1": torch.ones(h),
            "qkv_w": torch.zeros((nh + 2 * nkv) * d, h),
            "qkv_b": torch.zeros((nh + 2 * nkv) * d) if s.qkv_bias else None,
            "o_w": torch.zeros(h, nh * d),
            "o_b": torch.zeros(h) if s.o_bias else None,
            "ln2": torch.ones(h),
            "q_norm": torch.ones(d) if s.qk_norm else None,
            "k_norm": torch.ones(d) if s.qk_norm else None,
        }
        q_end, k_end = nh * d, (nh + nkv) * d
        for k, names in (
            ("ln1", ["input_layernorm.weight"]),
            ("qkv_w", ["self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight"]),
            ("qkv_b", ["self_attn.q_proj.bias", "self_attn.k_proj.bias", "self_attn.v_proj.bias"]),
            ("o_w", ["self_attn.o_proj.weight"]),
            ("o_b", ["self_attn.o_proj.bias"]),
            ("ln2", ["post_attention_layernorm.weight"]),
            ("q_norm", ["self_attn.q_norm.weight"]),
            ("k_norm", ["self_attn.k_norm.weight"]),
        ):
            if L[k] is not None:
                self.groups[f"layers.{i}.{k}"] = tuple(p + n for n in names)
        self.params[p + "input_layernorm.weight"] = L["ln1"]
        self.params[p + "self_attn.q_proj.weight"] = L["qkv_w"][:q_end]
        self.params[p + "self_attn.k_proj.weight"] = L["qkv_w"][q_end:k_end]
        self.params[p + "self_attn.v_proj.weight"] = L["qkv_w"][k_end:]
        if s.qkv_bias:
            self.params[p + "self_attn.q_proj.bias"] = L["qkv_b"][:q_end]
            self.params[p + "self_attn.k_proj.bias"] = L["qkv_b"][q_end:k_end]
            self.params[p + "self_attn.v_proj.bias"] = L["qkv_b"][k_end:]
        if s.qk_norm:
            self.params[p + "self_attn.q_norm.weight"] = L["q_norm"]
            self.params[p + "self_attn.k_norm.weight"] = L["k_norm"]
        self.params[p + "self_attn.o_proj.weight"] = L["o_w"]
        if s.o_bias:
            self.params[p + "self_attn.o_proj.bias"] = L["o_b"]
        self.params[p + "post_attention_layernorm.weight"] = L["ln2"]
        if s.is_moe_layer(i):
            self._add_experts(i, L)
        else:
            L["gu_w"], L["down_w"] = torch.zeros(2 * ffn, h), torch.zeros(h, ffn)
            self._add_views(i, "gu_w", {"mlp.gate_proj.weight": L["gu_w"][:ffn], "mlp.up_proj.weight": L["gu_w"][ffn:]})
            self._add_views(i, "down_w", {"mlp.down_proj.weight": L["down_w"]})
        return L

    def _add_views(self, i: int, buffer: str, views: dict[str, torch.Tensor]) -> None:
        """Register layer ``i``'s HF-named ``views`` (names relative to the layer) of its fused ``buffer``."""
        p = f"model.layers.{i}."
        self.groups[f"layers.{i}.{buffer}"] = tuple(p + n for n in views)
        for n, t in views.items():
            self.params[p + n] = t

    def _add_experts(self, i: int, L: dict[str, torch.Tensor]) -> None:
        """A sparse layer's MLP: the router [E, H] and every expert's SwiGLU in two [E, ...] buffers (module
        contract), one weight-sync group each."""
        s = self.spec
        h, E, f = s.hidden_size, s.num_experts, s.moe_ffn_hidden_size
        L["router_w"] = torch.zeros(E, h)
        L["experts_gu"] = torch.zeros(E, 2 * f, h)
        L["experts_down"] = torch.zeros(E, h, f)
        self._add_views(i, "router_w", {"mlp.gate.weight": L["router_w"]})
        gu = {}
        for e in range(E):
            gu[f"mlp.experts.{e}.gate_proj.weight"] = L["experts_gu"][e, :f]
            gu[f"mlp.experts.{e}.up_proj.weight"] = L["experts_gu"][e, f:]
        self._add_views(i, "experts_gu", gu)
        self._add_views(
            i, "experts_down", {f"mlp.experts.{e}.down_proj.weight": L["experts_down"][e] for e in range(E)}
        )

    def _buffer(self, group: str) -> torch.Tensor:
        if group.startswith("layers."):
            _, i, k = group.split(".")
            return self.layers[int(i)][k]
        return getattr(self, group)

    def _set_buffer(self, group: str, t: torch.Tensor) -> None:
        if group.startswith("layers."):
            _, i, k = group.split(".")
            self.layers[int(i)][k] = t
        else:
            setattr(self, group, t)
            if group == "embed" and self.spec.tie_word_embeddings:
                self.lm_head = t

    def swap_groups(self, other: CausalLM, groups: Iterable[str]) -> None:
        """Exchange whole weight buffers (and their HF-named views) with ``other``, a model of the same
        spec: O(1) per buffer, no copy. The weight-sync standby bank is swapped in this way."""
        assert other.spec == self.spec, "swap_groups needs two models of the same spec"
        for g in groups:
            mine, theirs = self._buffer(g), other._buffer(g)
            self._set_buffer(g, theirs)
            other._set_buffer(g, mine)
            for n in self.groups[g]:
                self.params[n], other.params[n] = other.params[n], self.params[n]

    # ---- weights -------------------------------------------------------------------------
    def load_weights(self, named: Iterable[tuple[str, torch.Tensor]], *, strict_names: bool = True) -> int:
        """Copy HF-named tensors into the model (any float dtype; rounded to ``weight_dtype``, held in fp32). Returns the
        number loaded. Unknown names raise ``KeyError`` naming them; ``lm_head.weight`` of a model
        with tied embeddings is skipped (as SGLang does)."""
        n = 0
        with torch.no_grad():
            for name, t in named:
                dst = self.params.get(name)
                if dst is None:
                    if self.skips(name) or not strict_names:
                        continue
                    raise KeyError(f"unknown parameter {name!r} for {self.spec.model_type}")
                if tuple(t.shape) != tuple(dst.shape):
                    raise ValueError(f"parameter {name!r}: shape {tuple(t.shape)} != model's {tuple(dst.shape)}")
                dst.copy_(t.to(self.weight_dtype).to(torch.float32))
                n += 1
        return n

    def skips(self, name: str) -> bool:
        """A name SGLang's loaders pass over without a word: a tied ``lm_head.weight``, ``rotary_emb.inv_freq``."""
        return name == "lm_head.weight" and self.spec.tie_word_embeddings or name.endswith("rotary_emb.inv_freq")

    def missing_after(self, names: set[str]) -> list[str]:
        return sorted(set(self.params) - names)

    # ---- forward -------------------------------------------------------------------------
    def _plan(
        self, past_len_B: torch.Tensor, new_len_B: torch.Tensor, kv: KVPool, *, row0: int, last_only: bool
    ) -> _Plan:
        """What every layer of one forward shares: rope tables, the attention masks, where the new KV goes."""
        s = self.spec
        B = past_len_B.shape[0]
        nh, nkv, d, scale = s.num_attention_heads, s.num_query_groups, s.head_dim, 1.0 / math.sqrt(s.head_dim)
        end_B = past_len_B + new_len_B
        kv.ensure_capacity(int(end_B.max()))
        # the leading rows with one new token (decode) take the batched one-query path
        num_decode = int((new_len_B == 1).cumprod(0).sum())
        if num_decode == B:  # decode only: token t is row t
            b_T, j_T = torch.arange(B), torch.zeros(B, dtype=torch.long)
        else:
            b_T = torch.repeat_interleave(torch.arange(B), new_len_B)
            start_B = torch.cumsum(new_len_B, 0) - new_len_B
            j_T = torch.arange(b_T.shape[0]) - start_B[b_T]
        pos_T = past_len_B[b_T] + j_T
        # rope tables for these positions, one row per head of the fused qkv ([T, heads, d] layout)
        freqs = pos_T.to(torch.float32)[:, None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]
        cos, sin = emb.cos(), emb.sin()
        T = pos_T.shape[0]
        v_one = torch.ones(T, nkv, d)
        cos = torch.cat((cos.mul(scale).expand(-1, nh, -1), cos.expand(-1, nkv, -1), v_one), dim=1)
        sin = torch.cat((sin.mul(scale).expand(-1, nh, -1), sin.expand(-1, nkv, -1), v_one * 0), dim=1)
        # flat index of (row, kv head, position) in a layer's cache viewed as [max_rows * kv_heads * capacity, d]
        slot_T = ((b_T + row0) * nkv)[:, None] + torch.arange(nkv)[None, :]
        kv_index = (slot_T * kv.capacity + pos_T[:, None]).reshape(-1)
        route_index = None if kv.routed is None else (b_T + row0) * kv.capacity + pos_T
        dec_L = int(past_len_B[:num_decode].max()) + 1 if num_decode else 0
        dec_bias = _hidden_bias(torch.arange(dec_L)[None, :] > past_len_B[:num_decode, None])[:, None, None]
        pad = None
        if num_decode < B:
            # the other rows, padded to their longest feed: query j of row b sees keys <= past_b + min(j, n_b - 1)
            p_B, n_B = past_len_B[num_decode:], new_len_B[num_decode:]
            N, L = int(n_B.max()), int(end_B[num_decode:].max())
            j_N = torch.arange(N)
            qpos_BN = p_B[:, None] + torch.minimum(j_N[None, :], (n_B - 1)[:, None])
            seen = (torch.arange(L)[None, None, :] <= qpos_BN[:, :, None])[:, None]  # [Bp, 1, N, L]
            seen = seen.repeat(1, 1, nh // nkv, 1)  # [Bp, 1, grp * N, L]: the grp query heads of a kv head
            pad = _Padded(b_T[num_decode:] - num_decode, j_T[num_decode:], _hidden_bias(~seen), N, L)
        last = None
        if last_only and num_decode < B:
            L = int(end_B.max())
            last = (
                torch.cumsum(new_len_B, 0) - 1,
                L,
                _hidden_bias(torch.arange(L)[None, :] >= end_B[:, None])[:, None, None],
            )
        return _Plan(cos, sin, kv_index, route_index, row0, num_decode, dec_L, dec_bias, pad, last)

    def _one_query(
        self, q_RHd: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, *, r0: int, L: int, bias_R11L: torch.Tensor
    ) -> torch.Tensor:
        """Attention of one query per row (rows r0 .. r0+R-1 of the cache, their first L keys) -> [R, heads * d].
        Grouped-query without repeating K/V: query head h reads kv head h // grp; [rows * kv heads] small
        matrix products in one bmm over 3-d views of the cache."""
        s = self.spec
        R, d, nh, nkv = q_RHd.shape[0], s.head_dim, s.num_attention_heads, s.num_query_groups
        grp = nh // nkv
        keys = kc[r0 : r0 + R, :, :L].reshape(R * nkv, L, d)
        vals = vc[r0 : r0 + R, :, :L].reshape(R * nkv, L, d)
        scores = torch.bmm(q_RHd.reshape(R * nkv, grp, d), keys.transpose(1, 2))
        scores.view(R, nkv, grp, L).add_(bias_R11L)
        return torch.bmm(torch.softmax(scores, dim=-1), vals).view(R, nh * d)

    def _attention(
        self, x: torch.Tensor, L: dict, *, kc: torch.Tensor, vc: torch.Tensor, plan: _Plan, last: bool = False
    ) -> torch.Tensor:
        """x + self-attention of one layer (writes the new tokens' K and V into this layer's cache rows). With
        ``last`` (and ``plan.last``): only each row's last token attends; returns [B, H] for those tokens."""
        s = self.spec
        T = x.shape[0]
        d, nh, nkv = s.head_dim, s.num_attention_heads, s.num_query_groups
        hdn = F.rms_norm(x, (s.hidden_size,), L["ln1"], s.rms_norm_eps)
        qkv = F.linear(hdn, L["qkv_w"], L["qkv_b"]).view(T, nh + 2 * nkv, d)
        if s.qk_norm:
            q = F.rms_norm(qkv[:, :nh], (d,), L["q_norm"], s.rms_norm_eps)
            k = F.rms_norm(qkv[:, nh : nh + nkv], (d,), L["k_norm"], s.rms_norm_eps)
            qkv = torch.cat((q, k, qkv[:, nh + nkv :]), dim=1)
        # rope on q and k (v's tables are 1 and 0), q scaled for the scores: three ops for every head at once
        qkv = torch.addcmul(qkv * plan.cos, torch.matmul(qkv, self.rot), plan.sin)
        kc.view(-1, d).index_copy_(0, plan.kv_index, qkv[:, nh : nh + nkv].reshape(-1, d))
        vc.view(-1, d).index_copy_(0, plan.kv_index, qkv[:, nh + nkv :].reshape(-1, d))
        q = qkv[:, :nh]
        if last and plan.last is not None:
            last_B, Lk, bias = plan.last
            att = self._one_query(q[last_B], kc, vc, r0=plan.row0, L=Lk, bias_R11L=bias)
            return x[last_B] + F.linear(att, L["o_w"], L["o_b"])
        nd, grp = plan.num_decode, nh // nkv
        parts = []
        if nd:
            parts.append(self._one_query(q[:nd], kc, vc, r0=plan.row0, L=plan.dec_L, bias_R11L=plan.dec_bias))
        if plan.pad is not None:
            p = plan.pad
            Bp, N = p.bias.shape[0], p.N
            r0 = plan.row0 + nd
            q_pad = q.new_zeros(Bp, N, nh, d)
            q_pad[p.b_idx, p.j_idx] = q[nd:]
            # [Bp, kv heads, grp * N, d]: the grp query heads of a kv head stacked along the queries
            q_pad = q_pad.view(Bp, N, nkv, grp, d).permute(0, 2, 3, 1, 4).reshape(Bp, nkv, grp * N, d)
            att = F.scaled_dot_product_attention(
                q_pad, kc[r0 : r0 + Bp, :, : p.L], vc[r0 : r0 + Bp, :, : p.L], attn_mask=p.bias, scale=1.0
            )
            att = att.view(Bp, nkv, grp, N, d).permute(0, 3, 1, 2, 4)[p.b_idx, p.j_idx]
            parts.append(att.reshape(-1, nh * d))
        att = parts[0] if len(parts) == 1 else torch.cat(parts)
        return x + F.linear(att, L["o_w"], L["o_b"])

    def _mlp(
        self, x: torch.Tensor, L: dict, routed: Optional[tuple[torch.Tensor, torch.Tensor]] = None
    ) -> torch.Tensor:
        """x + the layer's MLP; a sparse layer writes each token's experts into ``routed`` (this layer's
        [slots, top-k] of the pool's routing, each token's slot) when given."""
        s = self.spec
        hdn = F.rms_norm(x, (s.hidden_size,), L["ln2"], s.rms_norm_eps)
        if "router_w" in L:
            weights_Tk, experts_Tk = route(hdn, L["router_w"], s.num_experts_per_tok, renormalize=s.norm_topk_prob)
            if routed is not None:
                store, index = routed
                store.index_copy_(0, index, experts_Tk.to(torch.int32))
            return x + experts_mlp(hdn, L["experts_gu"], L["experts_down"], weights_Tk, experts_Tk)
        g, u = F.linear(hdn, L["gu_w"]).chunk(2, dim=-1)
        return x + F.linear(F.silu(g).mul_(u), L["down_w"])

    @torch.no_grad()
    def forward(
        self,
        tokens_T: torch.Tensor,
        past_len_B: torch.Tensor,
        new_len_B: torch.Tensor,
        kv: KVPool,
        *,
        row0: int,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Hidden states [T, H] of a packed batch whose KV lives in rows ``row0 .. row0+B-1`` (module contract);
        ``last_only``: [B, H], each row's last token only (every token's KV is still written; the last layer
        attends and runs its MLP for those B tokens alone, unless the pool keeps routing: then every token's
        routing is recorded and the last tokens picked at the end)."""
        capture = kv.routed is not None
        plan = self._plan(past_len_B, new_len_B, kv, row0=row0, last_only=last_only and not capture)
        x = F.embedding(tokens_T, self.embed)
        routed = None if kv.routed is None else kv.routed.view(-1, *kv.routed.shape[2:])
        n = len(self.layers)
        for layer, L in enumerate(self.layers):
            att = self._attention(x, L, kc=kv.k[layer], vc=kv.v[layer], plan=plan, last=layer == n - 1)
            x = self._mlp(att, L, None if routed is None else (routed[:, layer], plan.route_index))
        if capture and last_only and x.shape[0] > past_len_B.shape[0]:
            x = x[torch.cumsum(new_len_B, 0) - 1]
        return F.rms_norm(x, (self.spec.hidden_size,), self.norm, self.spec.rms_norm_eps)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.lm_head)


def iter_safetensors(model_dir: Path) -> Iterable[tuple[str, torch.Tensor]]:
    """Every tensor of a HF checkpoint directory (``asyncrl.models.safetensors_io``)."""
    return SafetensorsReader(model_dir).items()


def load_model(model_path: str | Path, *, weight_dtype: torch.dtype = torch.float32) -> CausalLM:
    """Load a HF checkpoint directory into a ``CausalLM`` (fp32 compute, weights rounded to ``weight_dtype``).
    Errors name the file/key."""
    p = Path(model_path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(f"model path {str(p)!r}: no config.json")
    model = CausalLM(require(ModelSpec.from_pretrained(p), CPU_ENGINE), weight_dtype=weight_dtype)
    seen: set[str] = set()
    for name, t in iter_safetensors(p):
        if model.load_weights([(name, t)]):
            seen.add(name)
    missing = model.missing_after(seen)
    if missing:
        raise ValueError(f"model path {str(p)!r}: checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")
    return model


class NoCheckpoint(FileNotFoundError):
    """A path that holds no checkpoint (not a directory, no safetensors file)."""


def read_checkpoint(model: CausalLM, d: Path) -> list[tuple[str, torch.Tensor]]:
    """Read a HF safetensors checkpoint directory for a load into the running ``model``: the same names and
    shapes, no parameter missing (``NoCheckpoint``, else a ``KeyError``/``ValueError`` naming the directory, or
    the file safetensors cannot read)."""
    if not d.is_dir():
        raise NoCheckpoint(f"{str(d)!r} is not a directory")
    if not any(d.glob("*.safetensors")):
        raise NoCheckpoint(f"{str(d)!r} holds no *.safetensors file")
    try:
        return _check_checkpoint(model, d)
    except SafetensorError as e:  # a truncated or corrupt file: an error of the request, never a 500
        raise ValueError(f"{_unreadable_file(d)!r}: not a readable safetensors file ({e})") from None


def _check_checkpoint(m: CausalLM, d: Path) -> list[tuple[str, torch.Tensor]]:
    named, seen = [], set()
    for name, t in iter_safetensors(d):
        dst = m.params.get(name)
        if dst is None:
            if m.skips(name):
                continue
            raise KeyError(f"{str(d)!r}: unknown parameter {name!r} for the running {m.spec.model_type}")
        if tuple(t.shape) != tuple(dst.shape):
            raise ValueError(
                f"{str(d)!r}: parameter {name!r} has shape {tuple(t.shape)}, the running model's is {tuple(dst.shape)}"
            )
        named.append((name, t))
        seen.add(name)
    missing = m.missing_after(seen)
    if missing:
        raise ValueError(f"{str(d)!r}: checkpoint lacks {len(missing)} parameters, e.g. {missing[:3]}")
    return named


def _unreadable_file(d: Path) -> str:
    """The first ``*.safetensors`` of ``d`` that safetensors cannot open (where a ``SafetensorError`` came from);
    ``d`` itself when each one opens."""
    for f in sorted(d.glob("*.safetensors")):
        try:
            with safe_open(str(f), framework="pt"):
                pass
        except SafetensorError:
            return str(f)
    return str(d)
