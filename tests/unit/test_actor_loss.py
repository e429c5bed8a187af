"""The pure loss functions against small hand-computed references."""

import math

import pytest
import torch

from asyncrl.actor.corrections import CorrectionParams, correct
from asyncrl.actor.loss import (
    aggregation_weights,
    finalize_metrics,
    grpo_advantages,
    kl_penalty,
    policy_loss,
    ppo_clip,
)

LN = math.log


def t(xs):
    return torch.tensor(xs, dtype=torch.float32)


def near(expected):
    """pytest.approx at float32's precision: the losses run in float32 (eps 1.2e-7), and exp/log kernels differ
    by an ulp or two between processors and ATEN_CPU_CAPABILITY; the default rel=1e-6 sits within 10x of one ulp.
    Measured worst |diff| / tolerance here: 0.008 (was 0.08 against the default)."""
    return pytest.approx(expected, rel=1e-5, abs=1e-6)  # abs: for the expected zeros


def test_grpo_advantages():
    adv = grpo_advantages(t([[1, 0, 0, 1], [2, 2, 2, 2]]), normalize_by_std=True)
    s = math.sqrt(1 / 3)  # unbiased std of [1,0,0,1]
    assert adv[0].tolist() == near([0.5 / (s + 1e-6), -0.5 / (s + 1e-6), -0.5 / (s + 1e-6), 0.5 / (s + 1e-6)])
    assert adv[1].tolist() == [0.0, 0.0, 0.0, 0.0]  # equal rewards: zero advantage, no NaN
    assert grpo_advantages(t([[3, 1]]), normalize_by_std=False).tolist() == [[1.0, -1.0]]
    assert grpo_advantages(t([[5.0]]), normalize_by_std=True).tolist() == [[0.0]]  # group of one


def test_aggregation_weights():
    masks = [[1, 1, 0], [1], [0, 0]]

    def flat(w):
        return [x for row in w for x in row]

    assert flat(aggregation_weights(masks, "token_mean")) == near([1 / 3, 1 / 3, 0, 1 / 3, 0, 0])
    assert flat(aggregation_weights(masks, "seq_mean_token_sum")) == near([0.5, 0.5, 0, 0.5, 0, 0])
    assert flat(aggregation_weights(masks, "seq_mean_token_mean")) == near([0.25, 0.25, 0, 0.5, 0, 0])
    with pytest.raises(ValueError, match="loss_agg_mode"):
        aggregation_weights(masks, "sum")


def test_ppo_clip_cases():
    ratio = [0.5, 1.0, 1.5, 1.5, 0.5, 4.0]
    adv = t([1, 1, 1, -1, -1, -1])
    logp = torch.log(t(ratio)).requires_grad_(True)
    loss, r, clipped, dual = ppo_clip(logp, torch.zeros(6), adv, clip_low=0.2, clip_high=0.28)
    assert r.tolist() == near(ratio)
    assert loss.tolist() == near([-0.5, -1.0, -1.28, 1.5, 0.8, 4.0])
    assert clipped.tolist() == [False, False, True, False, True, False]
    assert not dual.any()
    loss.sum().backward()
    g = logp.grad.tolist()
    assert g[2] == 0.0 and g[4] == 0.0  # clipped branch: no gradient
    assert g[0] == near(-0.5) and g[3] == near(1.5)  # d(-A r)/dlogp = -A r
    # dual clip (c = 3) bounds the loss of negative advantages at -A * c
    loss, _, clipped, dual = ppo_clip(
        torch.log(t(ratio)), torch.zeros(6), adv, clip_low=0.2, clip_high=0.28, dual_clip=3.0
    )
    assert loss.tolist() == near([-0.5, -1.0, -1.28, 1.5, 0.8, 3.0])
    assert dual.tolist() == [False] * 5 + [True]


def test_kl_estimators():
    logp, ref = t([LN(0.5)]), t([LN(0.25)])
    assert kl_penalty(logp, ref, "k1").item() == near(LN(2))
    assert kl_penalty(logp, ref, "k3").item() == near(0.5 + LN(2) - 1)
    assert kl_penalty(ref, ref, "k3").item() == 0.0


def test_policy_loss_masked_token_mean():
    # ratios 0.5, 1.5 (clipped to 1.28) and a masked token with a huge ratio that must not count
    logp = torch.log(t([0.5, 1.5, 50.0])).requires_grad_(True)
    out = policy_loss(
        logp,
        behav_logp=torch.zeros(3),
        prox_logp=None,
        advantages=t([1, 1, 1]),
        agg_weight=t([0.5, 0.5, 0.0]),
        mask=t([1, 1, 0]),
        clip_ratio_low=0.2,
        clip_ratio_high=0.28,
    )
    assert out.loss.item() == near(0.5 * -0.5 + 0.5 * -1.28)
    out.loss.backward()
    assert logp.grad.tolist() == near([-0.25, 0.0, 0.0])
    m = finalize_metrics(out.sums)
    assert m["train/clip_fraction"] == 0.5 and m["train/num_tokens"] == 2
    assert m["train/logprob_mismatch"] == near((LN(2) + LN(1.5)) / 2)


def test_zero_advantage_gives_zero_loss_and_gradient():
    logp = torch.log(t([0.7, 1.3])).requires_grad_(True)
    out = policy_loss(
        logp,
        behav_logp=torch.zeros(2),
        prox_logp=None,
        advantages=torch.zeros(2),
        agg_weight=t([0.5, 0.5]),
        mask=t([1, 1]),
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
    )
    out.loss.backward()
    assert out.loss.item() == 0.0 and logp.grad.abs().sum().item() == 0.0


def test_kl_and_entropy_terms():
    logp = t([LN(0.5), LN(0.5)]).requires_grad_(True)
    ref = t([LN(0.25), LN(0.5)])
    ent = t([2.0, 4.0])
    out = policy_loss(
        logp,
        behav_logp=logp.detach(),
        prox_logp=None,
        advantages=t([1, 1]),
        agg_weight=t([0.5, 0.5]),
        mask=t([1, 1]),
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        ref_logp=ref,
        kl_coef=0.1,
        kl_estimator="k3",
        entropy=ent,
        entropy_coef=0.01,
    )
    k3 = 0.5 + LN(2) - 1
    expected = 0.5 * (-1) * 2 + 0.1 * (0.5 * k3 + 0) - 0.01 * (0.5 * 2 + 0.5 * 4)
    assert out.loss.item() == near(expected)
    m = finalize_metrics(out.sums)
    assert m["train/kl"] == near(k3 / 2) and m["train/entropy"] == near(3.0)


def test_off_policy_corrections():
    behav = torch.log(t([0.25, 1 / 1.5]))  # rollout probs relative to the proximal policy (logp 0)
    prox = torch.zeros(2)
    raw = torch.exp(prox - behav)
    c = correct("tis", prox, behav, mask=None, seq=None, advantages=raw, params=CorrectionParams(2.0))
    assert raw.tolist() == near([4.0, 1.5]) and c.weight.tolist() == near([2.0, 1.5]) and c.keep.all()
    c = correct("decoupled", prox, behav, mask=None, seq=None, advantages=raw, params=CorrectionParams(2.0))
    assert (c.weight * c.keep).tolist() == near([0.0, 1.5]) and c.keep.tolist() == [False, True]
    common = dict(
        behav_logp=behav,
        prox_logp=prox,
        advantages=t([1, 1]),
        agg_weight=t([0.5, 0.5]),
        mask=t([1, 1]),
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        tis_cap=2.0,
    )
    logp = torch.zeros(2, requires_grad=True)  # current == proximal: ratio 1, no clipping
    tis = policy_loss(logp, off_policy_correction="tis", **common)
    assert tis.loss.item() == near(0.5 * -1 * 2.0 + 0.5 * -1 * 1.5)
    dec = policy_loss(logp, off_policy_correction="decoupled", **common)
    assert dec.loss.item() == near(0.5 * -1 * 1.5)
    md = finalize_metrics(dec.sums)
    assert md["train/is_dropped_fraction"] == 0.5 and md["train/behav_ratio_mean"] == near(2.75)
    assert md["train/logprob_mismatch"] == near((LN(4) + LN(1.5)) / 2)
    # none: the rollout log-prob is the old log-prob, so the ratio is 4 and 1.5 -> clipped at 1.2
    none = policy_loss(logp, off_policy_correction="none", **{**common, "prox_logp": None})
    assert none.loss.item() == near(0.5 * -1.2 + 0.5 * -1.2)
    with pytest.raises(ValueError, match="off_policy_correction"):
        policy_loss(logp, off_policy_correction="tis", **{**common, "prox_logp": None})
