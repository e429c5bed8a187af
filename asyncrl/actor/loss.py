"""The RL objective as pure functions: GRPO advantages, PPO clipping, KL, off-policy corrections.

No torch.distributed, no model: tensors in, tensors out. The trainer feeds flat per-token tensors
of one micro-batch (response tokens only) and sums the results over micro-batches and DP ranks.

Aggregation is expressed as a per-token weight ``agg_weight`` computed once for the *global*
batch (``aggregation_weights``), so that ``sum_t agg_weight_t * loss_t`` summed over all
micro-batches and ranks is exactly the chosen mean:

- ``token_mean``:          mask_t / (trained tokens in the global batch)
- ``seq_mean_token_sum``:  mask_t / (sequences with a trained token)
- ``seq_mean_token_mean``: mask_t / (len_trained(seq) * sequences with a trained token)

Off-policy correction (``algorithm.off_policy_correction``), with ``behav`` = the engine's
rollout log-prob and ``prox`` = the log-prob recomputed with the weights before this step:

- ``none``:      old = behav (the RLinf default: the rollout log-prob is the old log-prob).
- every other:   old = prox, and each token's loss is multiplied by the behaviour weight and kept or dropped
  as ``asyncrl.actor.corrections`` says: ``tis`` (truncated IS), ``decoupled`` (AReaL's decoupled PPO),
  ``token_mis`` / ``seq_mis`` (masked IS, token or sequence level), ``geo_mask`` (geometric-mean sequence mask),
  ``icepop``, ``dppo`` (prime-rl's default trust-region mask) and ``m2po``.

Per-token staleness (``staleness``: the actor's version at the step minus the token's weight version): with
``max_token_staleness`` set, older tokens are dropped whatever the correction; the step's distribution is
reported as ``train/token_staleness/*``.

Example::

    adv = grpo_advantages(torch.tensor([[1., 0., 0., 1.]]), normalize_by_std=True)
    out = policy_loss(logp, old_logp=behav, behav_logp=behav, prox_logp=None, advantages=adv_t,
                      agg_weight=w, mask=m, cfg=algorithm_cfg)
    out.loss.backward()
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

import torch

from asyncrl.actor.corrections import STALENESS_BUCKETS, CorrectionParams, correct, stale_mask, staleness_histogram

GRPO_STD_EPS = 1e-6
"""Added to the group std before dividing (equal rewards give std 0 and advantage 0)."""

AggMode = Literal["token_mean", "seq_mean_token_sum", "seq_mean_token_mean"]


def grpo_advantages(rewards: torch.Tensor, *, normalize_by_std: bool, eps: float = GRPO_STD_EPS) -> torch.Tensor:
    """Group-relative advantages. ``rewards``: [num_groups, group_size] -> same shape.

    ``(r - mean(group))``, divided by ``std(group) + eps`` (unbiased std) when ``normalize_by_std``.
    A group of one, or with equal rewards, gets advantage 0.
    """
    r = rewards.to(torch.float64)
    centred = r - r.mean(dim=-1, keepdim=True)
    if normalize_by_std and r.shape[-1] > 1:
        centred = centred / (r.std(dim=-1, keepdim=True) + eps)
    return centred.to(torch.float32)


def aggregation_weights(masks: Sequence[Sequence[int]], mode: AggMode) -> list[list[float]]:
    """Per-token weights for the whole (global) batch so that ``sum(w * loss)`` is the ``mode`` mean."""
    lengths = [int(sum(m)) for m in masks]
    num_seqs = sum(1 for n in lengths if n > 0)
    num_tokens = sum(lengths)
    out: list[list[float]] = []
    for m, n in zip(masks, lengths):
        if n == 0:
            out.append([0.0] * len(m))
        elif mode == "token_mean":
            out.append([float(x) / num_tokens for x in m])
        elif mode == "seq_mean_token_sum":
            out.append([float(x) / num_seqs for x in m])
        elif mode == "seq_mean_token_mean":
            out.append([float(x) / (n * num_seqs) for x in m])
        else:
            raise ValueError(
                f"algorithm.loss_agg_mode={mode!r} is not one of token_mean, seq_mean_token_sum, seq_mean_token_mean"
            )
    return out


def ppo_clip(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    dual_clip: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token clipped surrogate loss (to minimise).

    Returns ``(loss_t, ratio_t, clipped_t, dual_clipped_t)``; ``clipped_t`` marks tokens where the
    clipped branch is the active one (zero gradient), ``dual_clipped_t`` where the dual-clip bound
    ``-A * c`` (negative advantages only) is active.
    """
    ratio = torch.exp(logp - old_logp)
    pg1 = -advantages * ratio
    pg2 = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(pg1, pg2)
    clipped = pg2 > pg1
    dual = torch.zeros_like(clipped)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    return loss, ratio, clipped, dual


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, estimator: Literal["k1", "k3"]) -> torch.Tensor:
    """Per-token KL(pi || ref) estimate: k1 = log(pi/ref); k3 = ref/pi - log(ref/pi) - 1 (>= 0)."""
    if estimator == "k1":
        return logp - ref_logp
    if estimator == "k3":
        d = ref_logp - logp
        return torch.exp(d) - d - 1.0
    raise ValueError(f"algorithm.kl_estimator={estimator!r} is not one of k1, k3")


SUM_KEYS = (
    "num_tokens",
    "loss",
    "pg_loss",
    "clip_sum",
    "dual_clip_sum",
    "ratio_sum",
    "entropy_sum",
    "kl_sum",
    "mismatch_sum",
    "behav_ratio_sum",
    "iw_dropped_sum",
    "iw_truncated_sum",
    "mismatch_kl_sum",
    "masked_mismatch_sum",
    "stale_masked_sum",
    "staleness_sum",
    *(f"staleness_count_{k}" for k in range(STALENESS_BUCKETS + 1)),
)
"""The keys of ``LossOutput.sums`` (fixed, so ranks can all-reduce them as one vector)."""


@dataclass
class LossOutput:
    loss: torch.Tensor
    """Scalar to backpropagate: sum over tokens of agg_weight * per-token objective."""
    sums: dict[str, float] = field(default_factory=dict)
    """Metric numerators and token counts (``*_sum`` over trained tokens, ``num_tokens``), to be
    summed over micro-batches and ranks and divided by ``num_tokens``; ``loss`` and ``pg_loss``
    are already globally normalised (sum them, do not divide)."""


def _old_policy(
    logp: torch.Tensor,
    behav_logp: torch.Tensor,
    prox_logp: torch.Tensor | None,
    mask_b: torch.Tensor,
    *,
    correction: str,
    params: CorrectionParams,
    seq: torch.Tensor | None,
    advantages: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The PPO ratio's denominator, the behaviour weights, the tokens the correction keeps, and the raw ratio."""
    if correction == "none":
        return behav_logp, torch.ones_like(logp), mask_b, torch.exp(logp.detach() - behav_logp)
    if prox_logp is None:
        raise ValueError(f"algorithm.off_policy_correction={correction!r} needs the recomputed log-prob")
    c = correct(correction, prox_logp, behav_logp, mask=mask_b, seq=seq, advantages=advantages, params=params)
    return prox_logp, c.weight, mask_b & c.keep, torch.exp((prox_logp - behav_logp).detach())


def policy_loss(
    logp: torch.Tensor,
    *,
    behav_logp: torch.Tensor,
    prox_logp: torch.Tensor | None,
    advantages: torch.Tensor,
    agg_weight: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio_low: float,
    clip_ratio_high: float,
    dual_clip: float | None = None,
    off_policy_correction: str = "none",
    tis_cap: float = 2.0,
    correction_params: CorrectionParams | None = None,
    seq: torch.Tensor | None = None,
    staleness: torch.Tensor | None = None,
    max_token_staleness: int | None = None,
    entropy: torch.Tensor | None = None,
    entropy_coef: float = 0.0,
    ref_logp: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    kl_estimator: Literal["k1", "k3"] = "k3",
) -> LossOutput:
    """The full per-micro-batch objective; all inputs are flat [T] tensors of response tokens. ``mask`` (bool or
    0/1) marks trained tokens (tool tokens are 0); ``agg_weight`` is already 0 where the mask is 0. ``prox_logp``
    is required for every correction but ``none``; ``correction_params`` (default: the defaults, with ``tis_cap``)
    bound them; ``seq`` (each token's sequence in the micro-batch) is required for ``seq_mis`` and ``geo_mask``;
    ``staleness`` (per token, int) feeds ``train/token_staleness/*`` and ``max_token_staleness``."""
    mask_b = mask.bool()
    maskf = mask_b.to(logp.dtype)
    params = correction_params if correction_params is not None else CorrectionParams(tis_cap=tis_cap)
    old, iw, keep, raw = _old_policy(
        logp, behav_logp, prox_logp, mask_b, correction=off_policy_correction, params=params, seq=seq,
        advantages=advantages,
    )  # fmt: skip
    fresh = stale_mask(staleness, max_token_staleness) if staleness is not None else torch.ones_like(mask_b)
    pg, ratio, clipped, dual = ppo_clip(
        logp, old, advantages, clip_low=clip_ratio_low, clip_high=clip_ratio_high, dual_clip=dual_clip
    )
    w = agg_weight * (keep & fresh).to(logp.dtype)
    pg_loss = (w * (pg * iw)).sum()  # per token: pg * iw
    reg, kl_sum, ent_sum = _regularizers(
        logp, w, maskf, entropy=entropy, entropy_coef=entropy_coef, ref_logp=ref_logp, kl_coef=kl_coef,
        kl_estimator=kl_estimator,
    )  # fmt: skip
    total = pg_loss + reg
    sums = _loss_sums(
        logp, total=total, pg_loss=pg_loss, ratio=ratio, clipped=clipped, dual=dual, raw=raw, keep=keep,
        fresh=fresh, mask_b=mask_b, behav_logp=behav_logp, prox_logp=prox_logp, ent_sum=ent_sum, kl_sum=kl_sum,
        tis_cap=params.tis_cap if off_policy_correction == "tis" else None, staleness=staleness,
    )  # fmt: skip
    return LossOutput(loss=total, sums=sums)


def _regularizers(
    logp: torch.Tensor,
    w: torch.Tensor,
    maskf: torch.Tensor,
    *,
    entropy: torch.Tensor | None,
    entropy_coef: float,
    ref_logp: torch.Tensor | None,
    kl_coef: float,
    kl_estimator: Literal["k1", "k3"],
) -> tuple[torch.Tensor | float, float, float]:
    """The KL penalty minus the entropy bonus (weighted like the policy loss), and the KL and entropy sums."""
    total: torch.Tensor | float = 0.0
    kl_sum = ent_sum = 0.0
    if ref_logp is not None:
        kl = kl_penalty(logp, ref_logp, kl_estimator)
        if kl_coef:
            total = total + kl_coef * (w * kl).sum()
        kl_sum = float((kl.detach() * maskf).sum())
    if entropy is not None:
        if entropy_coef:
            total = total - entropy_coef * (w * entropy).sum()
        ent_sum = float((entropy.detach() * maskf).sum())
    return total, kl_sum, ent_sum


def _loss_sums(
    logp: torch.Tensor,
    *,
    total: torch.Tensor,
    pg_loss: torch.Tensor,
    ratio: torch.Tensor,
    clipped: torch.Tensor,
    dual: torch.Tensor,
    raw: torch.Tensor,
    keep: torch.Tensor,
    mask_b: torch.Tensor,
    behav_logp: torch.Tensor,
    prox_logp: torch.Tensor | None,
    ent_sum: float,
    kl_sum: float,
    tis_cap: float | None,
    fresh: torch.Tensor,
    staleness: torch.Tensor | None,
) -> dict[str, float]:
    """``LossOutput.sums`` of one micro-batch (``tis_cap`` None: nothing truncated, only ``tis`` truncates)."""
    maskf = mask_b.to(logp.dtype)
    mismatch_ref = prox_logp if prox_logp is not None else logp.detach()
    log_rho = (mismatch_ref - behav_logp).detach()
    dropped = mask_b & ~keep
    stale = torch.zeros_like(log_rho, dtype=torch.int64) if staleness is None else staleness.to(torch.int64)
    hist = staleness_histogram(stale, mask_b)
    return {
        **{f"staleness_count_{k}": c for k, c in enumerate(hist)},
        "staleness_sum": float((stale * mask_b).sum()),
        "stale_masked_sum": float((mask_b & ~fresh).sum()),
        "mismatch_kl_sum": float(((torch.exp(log_rho) - log_rho - 1.0) * maskf).sum()),
        "masked_mismatch_sum": float((log_rho.abs() * dropped).sum()),
        "num_tokens": float(maskf.sum()),
        "loss": float(total.detach()),
        "pg_loss": float(pg_loss.detach()),
        "clip_sum": float((clipped & mask_b).sum()),
        "dual_clip_sum": float((dual & mask_b).sum()),
        "ratio_sum": float((ratio.detach() * maskf).sum()),
        "entropy_sum": ent_sum,
        "kl_sum": kl_sum,
        "mismatch_sum": float(((mismatch_ref - behav_logp).abs() * maskf).sum()),
        "behav_ratio_sum": float((raw * maskf).sum()),
        "iw_dropped_sum": float(dropped.sum()),
        "iw_truncated_sum": float(((raw > tis_cap) & mask_b).sum()) if tis_cap is not None else 0.0,
    }


def finalize_metrics(sums: dict[str, float]) -> dict[str, float]:
    """Turn globally summed ``LossOutput.sums`` into the ``train/*`` metrics (token means)."""
    n = max(sums.get("num_tokens", 0.0), 1.0)
    return {
        "train/loss": sums.get("loss", 0.0),
        "train/pg_loss": sums.get("pg_loss", 0.0),
        "train/clip_fraction": sums.get("clip_sum", 0.0) / n,
        "train/dual_clip_fraction": sums.get("dual_clip_sum", 0.0) / n,
        "train/ratio_mean": sums.get("ratio_sum", 0.0) / n,
        "train/entropy": sums.get("entropy_sum", 0.0) / n,
        "train/kl": sums.get("kl_sum", 0.0) / n,
        "train/logprob_mismatch": sums.get("mismatch_sum", 0.0) / n,
        "train/behav_ratio_mean": sums.get("behav_ratio_sum", 0.0) / n,
        "train/is_dropped_fraction": sums.get("iw_dropped_sum", 0.0) / n,
        "train/is_truncated_fraction": sums.get("iw_truncated_sum", 0.0) / n,
        "train/num_tokens": sums.get("num_tokens", 0.0),
        "train/mismatch_kl": sums.get("mismatch_kl_sum", 0.0) / n,
        "train/masked_logprob_mismatch": sums.get("masked_mismatch_sum", 0.0)
        / max(sums.get("iw_dropped_sum", 0.0), 1.0),
        "train/stale_masked_fraction": sums.get("stale_masked_sum", 0.0) / n,
        **token_staleness_metrics(sums),
    }


def token_staleness_metrics(sums: dict[str, float]) -> dict[str, float]:
    """``train/token_staleness/{mean,max,ratio_<k>}`` of the trained tokens (``ratio_<k>``: the values present;
    ``STALENESS_BUCKETS`` stands for that many versions or more)."""
    counts = [sums.get(f"staleness_count_{k}", 0.0) for k in range(STALENESS_BUCKETS + 1)]
    n = sum(counts)
    if not n:
        return {}
    m = {
        "train/token_staleness/mean": sums.get("staleness_sum", 0.0) / n,
        "train/token_staleness/max": float(max(k for k, c in enumerate(counts) if c)),
    }
    for k, c in enumerate(counts):
        if c:
            m[f"train/token_staleness/ratio_{k}"] = c / n
    return m
