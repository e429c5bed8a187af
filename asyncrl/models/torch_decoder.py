"""A trainable plain-PyTorch decoder with HF parameter names (Qwen2 / Qwen3 / Llama).

Used for the embedded default's supervised warm start (one process, before the Megatron world
exists) and as the "plain PyTorch" baseline of ``benchmarks/actor_bench.py``. Its
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

    def forward(self, x, cos, sin, prefix_kv=None, kv_out=None, mask=None):
        """Causal self-attention; with ``prefix_kv`` (keys/values ``[1, nkv, P, d]`` of a prefix
        shared by every row) the rows also attend to that prefix. ``kv_out`` collects this call's
        keys/values (for use as the next call's prefix). ``mask`` (``[B, 1, T, P + T]``, True or 0.0 =
        attend, False or -inf = not) replaces the causal mask (packed rows: see ``hidden_states_shared_prefix``)."""
        B, T, _ = x.shape
        # one matmul for q, k and v (the HF parameters stay separate: same values, fewer passes over x)
        projs = (self.q_proj, self.k_proj, self.v_proj)
        bias = torch.cat([m.bias for m in projs]) if self.q_proj.bias is not None else None
        qkv = F.linear(x, torch.cat([m.weight for m in projs]), bias)
        q, k, v = qkv.split((self.nh * self.d, self.nkv * self.d, self.nkv * self.d), dim=-1)
        q = q.view(B, T, self.nh, self.d).transpose(1, 2)
        k = k.view(B, T, self.nkv, self.d).transpose(1, 2)
        v = v.view(B, T, self.nkv, self.d).transpose(1, 2)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        if kv_out is not None:
            kv_out.append((k, v))
        gqa = self.nh != self.nkv
        if prefix_kv is None:
            out = _attention_fp32(q, k, v, is_causal=True, enable_gqa=gqa)
        else:
            pk, pv = prefix_kv
            P = pk.shape[2]
            k = torch.cat((pk.expand(B, -1, -1, -1), k), dim=2)
            v = torch.cat((pv.expand(B, -1, -1, -1), v), dim=2)
            allowed = torch.ones(T, P + T, dtype=torch.bool).tril(P) if mask is None else mask
            out = _attention_fp32(q, k, v, attn_mask=allowed, enable_gqa=gqa)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.nh * self.d))


def _attention_fp32(q, k, v, **kw):
    """SDPA in float32 even under autocast (which would run it in bfloat16): on CPU, with this model's
    32-wide heads, bfloat16 attention is slower than float32 (measured), and float32 keeps its softmax exact.
    Without autocast this is plain SDPA (the casts are no-ops)."""
    with torch.autocast(q.device.type, enabled=False):
        return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), **kw)


def _rope(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


class _MLP(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        h, f = s.hidden_size, s.ffn_hidden_size
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x):
        gate, up = F.linear(x, torch.cat((self.gate_proj.weight, self.up_proj.weight))).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class _Layer(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.input_layernorm = _RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.self_attn = _Attention(s)
        self.post_attention_layernorm = _RMSNorm(s.hidden_size, s.rms_norm_eps)
        self.mlp = _MLP(s)

    def forward(self, x, cos, sin, prefix_kv=None, kv_out=None, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin, prefix_kv, kv_out, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class _Body(nn.Module):
    def __init__(self, s: ModelSpec):
        super().__init__()
        self.embed_tokens = nn.Embedding(s.vocab_size, s.hidden_size)
        self.layers = nn.ModuleList(_Layer(s) for _ in range(s.num_layers))
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
        self, prefix_P: torch.Tensor, ids_BS: torch.Tensor, segments_BS: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Hidden states of rows ``prefix + ids_BS[b]`` with the common prefix computed once:
        ``([1, P, H] of the prefix, [B, S, H] of the rows' own tokens)``. Equal to
        ``hidden_states(cat(prefix, row))`` split at P; gradients flow through the prefix once.

        ``segments_BS`` (int, ``>= 0``) packs several sequences per row: each maximal run of one
        segment id is a sequence ``prefix + run`` of its own (positions restart after the prefix,
        attention stays inside the run and the prefix), so short sequences share a row instead of
        being padded to the longest. Equal to running each sequence alone."""
        kvs: list = []
        P = prefix_P.shape[0]
        h_prefix = self._run(prefix_P[None], offset=0, kv_out=kvs)
        if segments_BS is None:
            return h_prefix, self._run(ids_BS, offset=P, prefix_kvs=kvs)
        B, S = ids_BS.shape
        start_BS = torch.ones(B, S, dtype=torch.bool)
        start_BS[:, 1:] = segments_BS[:, 1:] != segments_BS[:, :-1]
        idx_S = torch.arange(S)
        # position of each token inside its run: its index minus the index of its run's first token
        first_BS = torch.cummax(torch.where(start_BS, idx_S, 0), dim=1).values
        positions_BS = P + idx_S - first_BS
        run_BS = torch.cumsum(start_BS, dim=1)
        same_BSS = run_BS[:, :, None] == run_BS[:, None, :]
        own_BSS = same_BSS & torch.ones(S, S, dtype=torch.bool).tril()
        allowed = torch.cat((torch.ones(B, S, P, dtype=torch.bool), own_BSS), dim=2)[:, None]
        # as an additive float mask, built once for every layer: CPU SDPA turns a bool mask into one per call,
        # and runs ~8% slower with it (measured, forward and backward); no row is all -inf (the prefix is open)
        mask = torch.zeros(allowed.shape).masked_fill_(~allowed, float("-inf"))
        return h_prefix, self._run(ids_BS, offset=P, prefix_kvs=kvs, positions_BT=positions_BS, mask=mask)

    def _run(
        self,
        ids_BT: torch.Tensor,
        *,
        offset: int,
        kv_out: list | None = None,
        prefix_kvs: list | None = None,
        positions_BT: torch.Tensor | None = None,
        mask: torch.Tensor | None = None,
    ) -> torch.Tensor:
        T = ids_BT.shape[1]
        if positions_BT is None:
            freqs = torch.arange(offset, offset + T, dtype=torch.float32)[:, None] * self.inv_freq[None, :]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos()[None, None], emb.sin()[None, None]
        else:
            freqs = positions_BT.to(torch.float32)[..., None] * self.inv_freq
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos()[:, None], emb.sin()[:, None]
        x = self.model.embed_tokens(ids_BT)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, cos, sin, prefix_kvs[i] if prefix_kvs is not None else None, kv_out, mask)
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
