"""Qwen3-MoE's sparse MLP for the CPU engine's decoder (``model``): the experts' products (the router is
``asyncrl.models.routing.route``, shared with the plain decoder).

Contract
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
