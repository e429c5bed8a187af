"""Qwen3-MoE's router, pure torch: the one place that says how a token picks its experts.

Contract
- ``route(hdn, router_w, k, renormalize=...)``: each token's top-k experts and their weights, as transformers'
  ``Qwen3MoeTopKRouter`` and SGLang's ``TopK`` compute them (fp32 softmax of the router logits, top-k, renormalised
  to sum 1 when ``norm_topk_prob``). Used by the plain decoder (``torch_decoder``) and the CPU engine
  (``asyncrl.cpu_engine.model``); the actor runs megatron-core's router, configured to the same rule.

    weights_Tk, experts_Tk = route(hdn_TH, router_EH, 2, renormalize=True)
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
