"""Qwen3-MoE's sparse MLP for the CPU engine's decoder (``model``): the router and the experts' products.

Contract
- ``route(hdn, router_w, k, renormalize=...)``: each token's top-k experts and their weights, as transformers'
  ``Qwen3MoeTopKRouter`` and SGLang's ``TopK`` compute them (fp32 softmax of the router logits, top-k, renormalised
  to sum 1 when ``norm_topk_prob``).
- ``experts_mlp(hdn, gate_up, down, weights, experts)``: the sum over each token's experts of ``weight *
  down(silu(gate(x)) * up(x))``, the tokens sorted by expert so that each expert hit runs one pair of matrix
  products over all its tokens (never a loop per token).

    weights_Tk, experts_Tk = route(hdn_TH, router_EH, 2, renormalize=True)
    out_TH = experts_mlp(hdn_TH, gate_up_E2FH, down_EHF, weights_Tk, experts_Tk)

Pure torch (no I/O, no state).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def route(hdn: torch.Tensor, router_w: torch.Tensor, k: int, *, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen3-MoE's router over tokens ``hdn`` [T, H]: (weights [T, k], experts [T, k]), the experts in order of
    falling probability. Probabilities are the fp32 softmax of ``hdn @ router_w.T``; the top-k of them,
    renormalised to sum to 1 when ``renormalize`` (``norm_topk_prob``)."""
    probs = torch.softmax(F.linear(hdn, router_w), dim=-1, dtype=torch.float32)
    weights, experts = torch.topk(probs, k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


def experts_mlp(
    hdn: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, weights_Tk: torch.Tensor, experts_Tk: torch.Tensor
) -> torch.Tensor:
    """The sparse MLP of tokens ``hdn`` [T, H] routed to ``experts_Tk`` with ``weights_Tk`` (``route``), with every
    expert's SwiGLU in ``gate_up`` [E, 2F, H] (gate rows, then up rows) and ``down`` [E, H, F]: [T, H]."""
    k = experts_Tk.shape[1]
    flat = experts_Tk.reshape(-1)
    order = torch.argsort(flat, stable=True)
    token = order // k  # the token of each (token, choice) pair, in expert order
    weight = weights_Tk.reshape(-1, 1)[order]
    out = torch.zeros_like(hdn)
    start = 0
    for e, n in enumerate(torch.bincount(flat, minlength=gate_up.shape[0]).tolist()):
        if n:
            rows = token[start : start + n]
            g, u = F.linear(hdn[rows], gate_up[e]).chunk(2, dim=-1)
            out.index_add_(0, rows, F.linear(F.silu(g).mul_(u), down[e]).mul_(weight[start : start + n]))
            start += n
    return out
