"""Off-policy corrections as pure functions: which tokens stay in the loss, and the weight of each.

No model, no torch.distributed: flat per-token tensors of one micro-batch in, tensors out. The loss
(``asyncrl.actor.loss.policy_loss``) calls ``correct`` once per micro-batch. Every correction reads the
behaviour ratio ``rho_t = exp(prox_t - behav_t)``: the recomputed log-prob of the weights at the start of the
step (``prox``) over the engine's (``behav``), detached. It returns ``Correction(weight, keep)``: the loss of a
token is ``keep_t * weight_t * ppo_t`` where ``ppo_t`` is the clipped PPO surrogate against ``prox`` (the
decoupled objective: the PPO ratio against the proximal policy, the behaviour ratio as an importance weight).

Contract (``algorithm.off_policy_correction``; ``seq``: a token's sequence in the micro-batch; sequence-level
figures are over the sequence's trained tokens):

==============  ==========================================  =================================================
name            keeps                                       weight of a kept token
==============  ==========================================  =================================================
``tis``         every token                                 ``min(rho_t, tis_cap)`` (truncated IS)
``decoupled``   ``rho_t <= tis_cap`` (AReaL's decoupled     ``rho_t``: the same tokens and weights as
                PPO)                                        ``token_mis``
``token_mis``   ``rho_t <= tis_cap`` (masked IS)            ``rho_t``
``seq_mis``     sequences with ``rho_seq <= tis_cap``,      ``rho_seq = exp(sum_seq log rho)``
                ``rho_seq`` the product of the ratios
``geo_mask``    sequences whose geometric mean              1 (a rejection mask, no weight)
                ``exp(mean_seq log rho)`` is in
                ``[geo_mask_low, geo_mask_high]``
``icepop``      ``icepop_low <= rho_t <= icepop_high``      ``rho_t`` (IcePop: two-sided token mask)
``dppo``        all but the tokens whose probability moved  ``rho_t`` (DPPO's binary-TV trust region,
                past the bound in the advantage's           prime-rl's default loss)
                direction: ``A > 0`` and ``p - mu >
                dppo_mask_high``, or ``A < 0`` and
                ``mu - p > dppo_mask_low``
``m2po``        all but the fewest largest ``(log rho)^2``  ``rho_t`` (M2PO: a second-moment trust region)
                tokens whose removal brings the kept
                tokens' mean ``(log rho)^2`` to at most
                ``m2po_tau`` (over the micro-batch)
==============  ==========================================  =================================================

``none`` is not here: the loss then takes the engine's log-prob as the old one and computes no ``prox``.
Independently of the correction, ``stale_mask`` drops tokens generated more than ``max_token_staleness``
versions before the step (the per-token versions of ``asyncrl.broker.record``).

    c = correct("icepop", prox - behav, mask=m, seq=s, advantages=adv, params=CorrectionParams())
    loss_t = c.keep * c.weight * ppo_t
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from asyncrl.config.schema import AlgorithmConfig as _ALGO

CORRECTIONS = ("none", "tis", "decoupled", "token_mis", "seq_mis", "geo_mask", "icepop", "dppo", "m2po")
"""The values of ``algorithm.off_policy_correction``."""

MAX_LOG_RATIO = 20.0
"""A sequence's summed log-ratio is clamped here before ``exp`` (e^20 ~ 5e8: beyond any cap, finite in fp32)."""


@dataclass(frozen=True)
class CorrectionParams:
    """The bounds of the corrections (``algorithm.*`` of the same names; the defaults are the config's, read from
    ``AlgorithmConfig`` so they are written once)."""

    tis_cap: float = _ALGO.tis_cap
    geo_mask_low: float = _ALGO.geo_mask_low
    geo_mask_high: float = _ALGO.geo_mask_high
    icepop_low: float = _ALGO.icepop_low
    icepop_high: float = _ALGO.icepop_high
    dppo_mask_low: float = _ALGO.dppo_mask_low
    dppo_mask_high: float = _ALGO.dppo_mask_high
    m2po_tau: float = _ALGO.m2po_tau


@dataclass
class Correction:
    weight: torch.Tensor
    """Per token: the importance weight of a kept token (0 where dropped)."""
    keep: torch.Tensor
    """Per token (bool): the token stays in the loss."""


def _seq_sum(x: torch.Tensor, seq: torch.Tensor, num_seqs: int) -> torch.Tensor:
    return torch.zeros(num_seqs, dtype=x.dtype, device=x.device).index_add_(0, seq, x)


def tis(log_ratio: torch.Tensor, *, cap: float) -> Correction:
    """Truncated IS: every token, weight ``min(rho, cap)``."""
    rho = torch.exp(log_ratio)
    return Correction(torch.clamp(rho, max=cap), torch.ones_like(rho, dtype=torch.bool))


def token_mis(log_ratio: torch.Tensor, *, cap: float) -> Correction:
    """Token-level masked IS: tokens with ``rho <= cap``, weight ``rho``."""
    rho = torch.exp(log_ratio)
    keep = rho <= cap
    return Correction(torch.where(keep, rho, torch.zeros_like(rho)), keep)


def seq_mis(log_ratio: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor, *, cap: float) -> Correction:
    """Sequence-level masked IS: sequences whose ratio product is ``<= cap``; each token weighs the product."""
    n = int(seq.max()) + 1 if len(seq) else 0
    lr = torch.where(mask, log_ratio, torch.zeros_like(log_ratio))
    rho_seq = torch.exp(torch.clamp(_seq_sum(lr, seq, n), max=MAX_LOG_RATIO))[seq]
    keep = rho_seq <= cap
    return Correction(torch.where(keep, rho_seq, torch.zeros_like(rho_seq)), keep)


def geo_mask(log_ratio: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor, *, low: float, high: float) -> Correction:
    """Geometric-mean sequence mask: sequences with ``low <= exp(mean log rho) <= high``, weight 1."""
    n = int(seq.max()) + 1 if len(seq) else 0
    m = mask.to(log_ratio.dtype)
    count = torch.clamp(_seq_sum(m, seq, n), min=1.0)
    geo = torch.exp(_seq_sum(log_ratio * m, seq, n) / count)[seq]
    keep = (geo >= low) & (geo <= high)
    return Correction(keep.to(log_ratio.dtype), keep)


def icepop(log_ratio: torch.Tensor, *, low: float, high: float) -> Correction:
    """IcePop: tokens with ``low <= rho <= high``, weight ``rho``."""
    rho = torch.exp(log_ratio)
    keep = (rho >= low) & (rho <= high)
    return Correction(torch.where(keep, rho, torch.zeros_like(rho)), keep)


def dppo(
    prox_logp: torch.Tensor, behav_logp: torch.Tensor, advantages: torch.Tensor, *, low: float, high: float
) -> Correction:
    """DPPO's binary-TV mask: drop a token whose probability moved past the bound in its advantage's direction
    (``p - mu > high`` for ``A > 0``, ``mu - p > low`` for ``A < 0``); weight ``rho``."""
    diff = torch.exp(prox_logp) - torch.exp(behav_logp)
    drop = ((advantages > 0) & (diff > high)) | ((advantages < 0) & (diff < -low))
    rho = torch.exp(prox_logp - behav_logp)
    return Correction(torch.where(drop, torch.zeros_like(rho), rho), ~drop)


def m2po(log_ratio: torch.Tensor, mask: torch.Tensor, *, tau: float) -> Correction:
    """M2PO: drop the fewest trained tokens, largest ``(log rho)^2`` first, that bring the mean ``(log rho)^2`` of
    the trained tokens kept to ``<= tau``; weight ``rho``."""
    sq = torch.where(mask, log_ratio.square(), torch.zeros_like(log_ratio))
    n = int(mask.sum())
    keep = torch.ones_like(mask, dtype=torch.bool)
    if n:
        vals, order = torch.sort(sq[mask], descending=True)
        # dropping the k largest leaves (total - prefix_k) / (n - k); the smallest k for which that is <= tau
        prefix = torch.cat([vals.new_zeros(1), torch.cumsum(vals, 0)])
        remaining = (prefix[-1] - prefix[:-1]) / torch.arange(n, 0, -1, dtype=vals.dtype, device=vals.device)
        ok = torch.nonzero(remaining <= tau)
        k = int(ok[0]) if len(ok) else n
        idx = torch.nonzero(mask).squeeze(1)[order[:k]]
        keep[idx] = False
    rho = torch.exp(log_ratio)
    return Correction(torch.where(keep, rho, torch.zeros_like(rho)), keep)


def correct(
    name: str,
    prox_logp: torch.Tensor,
    behav_logp: torch.Tensor,
    *,
    mask: torch.Tensor,
    seq: torch.Tensor | None,
    advantages: torch.Tensor,
    params: CorrectionParams,
) -> Correction:
    """The correction ``name`` (not ``none``) of one micro-batch (see the module contract); inputs detached here."""
    prox_logp, behav_logp = prox_logp.detach(), behav_logp.detach()
    lr = prox_logp - behav_logp
    p = params
    if name == "tis":
        return tis(lr, cap=p.tis_cap)
    if name in ("decoupled", "token_mis"):
        return token_mis(lr, cap=p.tis_cap)
    if name == "icepop":
        return icepop(lr, low=p.icepop_low, high=p.icepop_high)
    if name == "dppo":
        return dppo(prox_logp, behav_logp, advantages, low=p.dppo_mask_low, high=p.dppo_mask_high)
    if name == "m2po":
        return m2po(lr, mask, tau=p.m2po_tau)
    if name in ("seq_mis", "geo_mask"):
        if seq is None:
            raise ValueError(f"algorithm.off_policy_correction={name!r} needs each token's sequence (seq)")
        if name == "seq_mis":
            return seq_mis(lr, mask, seq, cap=p.tis_cap)
        return geo_mask(lr, mask, seq, low=p.geo_mask_low, high=p.geo_mask_high)
    raise ValueError(f"algorithm.off_policy_correction={name!r} is not one of {', '.join(CORRECTIONS)}")


def stale_mask(staleness: torch.Tensor, max_staleness: int | None) -> torch.Tensor:
    """Per token (bool): generated at most ``max_staleness`` versions before the step (None: every token)."""
    if max_staleness is None:
        return torch.ones_like(staleness, dtype=torch.bool)
    return staleness <= max_staleness


STALENESS_BUCKETS = 16
"""``train/token_staleness/ratio_<k>`` is exact for k < 16; older tokens count in the last bucket (16 = "16+")."""


def staleness_histogram(staleness: torch.Tensor, mask: torch.Tensor) -> list[float]:
    """Trained tokens per staleness 0 .. ``STALENESS_BUCKETS`` (the last: that many versions or more)."""
    s = torch.clamp(staleness[mask.bool()].to(torch.int64), 0, STALENESS_BUCKETS)
    return [float(c) for c in torch.bincount(s, minlength=STALENESS_BUCKETS + 1).tolist()]
