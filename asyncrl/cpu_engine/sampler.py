"""The CPU engine's sampling: one token per running request from its logits (temperature, top-k, top-p, min-p,
min_new_tokens), with the chosen token's log-prob under the temperature-scaled distribution.

    tokens, logprobs = sample(logits_BV, reqs, generator=torch.Generator().manual_seed(0), eos_ids={2})

Pure (no I/O). Greedy requests (temperature ~0 or top_k 1) take the argmax; the others draw by inverse CDF
from one uniform each (the engine's generator, or the request's own ``sampling_seed`` stream).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from asyncrl.cpu_engine.request import Request


def _ban_stop_tokens(logits_BV: torch.Tensor, reqs: Sequence[Request], eos_ids: set[int]) -> torch.Tensor:
    """min_new_tokens: eos and stop tokens get -inf until the request has that many tokens (a copy of the logits
    when any is banned, else the logits themselves)."""
    V = logits_BV.shape[1]
    out = logits_BV
    for b, r in enumerate(reqs):
        if len(r.output_ids) < r.params.min_new_tokens:
            ban = set(r.params.stop_token_ids) | (set() if r.params.ignore_eos else eos_ids)
            ban = [t for t in ban if 0 <= t < V]
            if ban:
                if out is logits_BV:
                    out = logits_BV.clone()
                out[b, ban] = float("-inf")
    return out


def _truncate(probs_BV: torch.Tensor, reqs: Sequence[Request]) -> tuple[torch.Tensor, torch.Tensor]:
    """Sorted probabilities with what top-k / top-p / min-p drop set to 0 (the top token always stays), and the
    sort order (sorted index -> token id)."""
    V = probs_BV.shape[1]
    probs, order = probs_BV.sort(dim=-1, descending=True)
    top_k = torch.tensor([r.params.top_k if r.params.top_k > 0 else V for r in reqs])
    top_p = torch.tensor([r.params.top_p for r in reqs])
    min_p = torch.tensor([r.params.min_p for r in reqs])
    rank = torch.arange(V)[None, :]
    cum = probs.cumsum(dim=-1)
    drop = (rank >= top_k[:, None]) | ((cum - probs) > top_p[:, None])
    drop |= probs < (min_p[:, None] * probs[:, :1])
    drop[:, 0] = False
    return probs.masked_fill(drop, 0.0), order


def sample(
    logits_BV: torch.Tensor, reqs: Sequence[Request], *, generator: torch.Generator, eos_ids: set[int]
) -> tuple[list[int], list[float]]:
    """One token and its log-prob per row of ``logits_BV`` (row b is ``reqs[b]``)."""
    B, V = logits_BV.shape
    logits_BV = _ban_stop_tokens(logits_BV.float(), reqs, eos_ids)
    temps = [1.0 if r.params.greedy else r.params.temperature for r in reqs]
    scaled = logits_BV if all(t == 1.0 for t in temps) else logits_BV / torch.tensor(temps)[:, None]
    logp = torch.log_softmax(scaled, dim=-1)
    greedy_list = [r.params.greedy for r in reqs]
    greedy = torch.tensor(greedy_list)
    out = scaled.argmax(dim=-1) if any(greedy_list) else None
    if not all(greedy_list):
        probs = logp.exp()
        order = None
        if any(r.params.top_k > 0 or r.params.top_p < 1 or r.params.min_p > 0 for r in reqs):
            probs, order = _truncate(probs, reqs)
        u = torch.rand(B, generator=generator)
        for b, r in enumerate(reqs):
            if r.generator is not None:  # sampling_seed: a per-request stream
                u[b] = torch.rand((), generator=r.generator)
        cdf = probs.cumsum(dim=-1)
        pick = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp(max=V - 1)[:, 0]
        # never pick a zero-probability token (float edge at the top of the cdf)
        sampled = order.gather(1, pick[:, None])[:, 0] if order is not None else pick
        out = sampled if out is None else torch.where(greedy, out, sampled)
    lps = logp.gather(1, out[:, None])[:, 0]
    return out.tolist(), lps.tolist()
