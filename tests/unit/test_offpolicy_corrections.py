"""The off-policy correction family (``asyncrl.actor.corrections``), each against a hand-computed case; per-token
staleness from the versions a trajectory carries to the loss; the config keys that choose and bound them."""

from __future__ import annotations

import math
import typing

import pytest
import torch

from asyncrl.actor import corrections as C
from asyncrl.actor.batch import Sample, microbatch_extras, token_staleness
from asyncrl.actor.loss import finalize_metrics, policy_loss
from asyncrl.config.loader import config_from_dict
from asyncrl.config.schema import AlgorithmConfig, ConfigError
from asyncrl.config.validate import _warn_correction_params

LN = math.log


def t(xs):
    return torch.tensor(xs, dtype=torch.float32)


def near(expected):
    return pytest.approx(expected, rel=1e-5, abs=1e-6)


def lr(ratios):
    """log-ratios of the given behaviour ratios rho = p_actor / p_engine."""
    return torch.log(t(ratios))


def test_tis_truncates_every_token():
    c = C.tis(lr([4.0, 1.5, 0.25]), cap=2.0)
    assert c.weight.tolist() == near([2.0, 1.5, 0.25]) and c.keep.all()


def test_token_mis_masks_tokens_over_the_cap_and_decoupled_is_the_same():
    c = C.token_mis(lr([4.0, 1.5, 0.25]), cap=2.0)
    assert c.weight.tolist() == near([0.0, 1.5, 0.25]) and c.keep.tolist() == [False, True, True]
    d = C.correct("decoupled", lr([4.0, 1.5, 0.25]), torch.zeros(3), mask=None, seq=None, advantages=t([1, 1, 1]),
                  params=C.CorrectionParams())  # fmt: skip
    assert torch.equal(d.keep, c.keep) and torch.allclose(d.weight, c.weight)


def test_seq_mis_weighs_each_token_by_its_sequence_product_over_trained_tokens():
    # seq 0: 2 x 1.5 = 3 > cap -> dropped; seq 1: 0.5 x 2 = 1 (its tool token, ratio 100, is not trained)
    c = C.seq_mis(lr([2.0, 1.5, 0.5, 100.0, 2.0]), t([1, 1, 1, 0, 1]).bool(), torch.tensor([0, 0, 1, 1, 1]), cap=2.0)
    assert c.keep.tolist() == [False, False, True, True, True]
    assert c.weight.tolist() == near([0.0, 0.0, 1.0, 1.0, 1.0])


def test_geo_mask_keeps_sequences_whose_geometric_mean_ratio_is_in_bounds():
    # seq 0: sqrt(2 x 0.5) = 1 -> kept; seq 1: sqrt(1.5 x 1.5) = 1.5 -> dropped
    c = C.geo_mask(lr([2.0, 0.5, 1.5, 1.5]), t([1, 1, 1, 1]).bool(), torch.tensor([0, 0, 1, 1]), low=0.9, high=1.1)
    assert c.keep.tolist() == [True, True, False, False] and c.weight.tolist() == [1.0, 1.0, 0.0, 0.0]


def test_icepop_masks_both_sides():
    c = C.icepop(lr([0.4, 1.0, 6.0, 5.0, 0.5]), low=0.5, high=5.0)
    assert c.keep.tolist() == [False, True, False, True, True]
    assert c.weight.tolist() == near([0.0, 1.0, 0.0, 5.0, 0.5])


def test_dppo_masks_only_moves_past_the_bound_in_the_advantages_direction():
    # engine prob mu, actor prob p; A > 0 and p - mu = 0.3 > 0.2: dropped; the same move with A < 0 is kept;
    # A < 0 and mu - p = 0.3: dropped; the same move with A > 0 is kept; A = 0 is never masked
    mu = t([0.1, 0.1, 0.5, 0.5, 0.1])
    p = t([0.4, 0.4, 0.2, 0.2, 0.4])
    c = C.dppo(torch.log(p), torch.log(mu), t([1.0, -1.0, -1.0, 1.0, 0.0]), low=0.2, high=0.2)
    assert c.keep.tolist() == [False, True, False, True, True]
    assert c.weight.tolist() == near([0.0, 4.0, 0.0, 0.4, 4.0])


def test_m2po_drops_the_fewest_largest_squared_log_ratios():
    # (log rho)^2 = 4, .01, .01, 0, 1 (+ an untrained token of 9): mean 1.004 > .04; without 4: .255; without 4 and
    # 1: .02/3 <= .04 -> the tokens of log-ratio 2 and 1 are dropped
    x = t([2.0, 0.1, -0.1, 0.0, 1.0, 3.0])
    c = C.m2po(x, t([1, 1, 1, 1, 1, 0]).bool(), tau=0.04)
    assert c.keep.tolist() == [False, True, True, True, False, True]
    assert c.weight[1:4].tolist() == near([math.exp(0.1), math.exp(-0.1), 1.0]) and c.weight[0] == 0
    assert C.m2po(t([0.1, -0.1]), t([1, 1]).bool(), tau=0.04).keep.all()  # already within the bound


def test_policy_loss_with_each_mask_and_its_report():
    # rho = 4, 1.5, 0.25 (current == proximal: PPO ratio 1, no clipping); token_mis drops the first
    behav, prox = lr([0.25, 1 / 1.5, 4.0]), torch.zeros(3)
    common = dict(
        behav_logp=behav,
        prox_logp=prox,
        advantages=t([1, 1, 1]),
        agg_weight=t([1 / 3] * 3),
        mask=t([1, 1, 1]),
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        seq=torch.tensor([0, 0, 1]),
    )
    logp = torch.zeros(3, requires_grad=True)
    out = policy_loss(logp, off_policy_correction="token_mis", **common)
    assert out.loss.item() == near(-(1.5 + 0.25) / 3)
    m = finalize_metrics(out.sums)
    assert m["train/is_dropped_fraction"] == near(1 / 3)
    assert m["train/masked_logprob_mismatch"] == near(LN(4))  # what the mask dropped: the token of ratio 4
    k3 = sum(r - LN(r) - 1 for r in (4.0, 1.5, 0.25)) / 3
    assert m["train/mismatch_kl"] == near(k3)
    out = policy_loss(logp, off_policy_correction="icepop", **common)  # 0.25 < 0.5: dropped; 4 and 1.5 kept
    assert out.loss.item() == near(-(4.0 + 1.5) / 3)
    out = policy_loss(logp, off_policy_correction="seq_mis", **common)  # seq 0: 4 x 1.5 = 6 > 2; seq 1: 0.25
    assert out.loss.item() == near(-0.25 / 3)
    with pytest.raises(ValueError, match="needs each token's sequence"):
        policy_loss(logp, off_policy_correction="geo_mask", **{**common, "seq": None})


def test_stale_tokens_leave_the_loss_and_the_staleness_distribution_is_reported():
    common = dict(
        behav_logp=torch.zeros(4),
        prox_logp=None,
        advantages=t([1, 1, 1, 1]),
        agg_weight=t([0.25] * 4),
        mask=t([1, 1, 1, 1]),
        clip_ratio_low=0.2,
        clip_ratio_high=0.2,
        staleness=torch.tensor([0, 1, 3, 2]),
    )
    logp = torch.zeros(4, requires_grad=True)
    out = policy_loss(logp, max_token_staleness=2, **common)
    assert out.loss.item() == near(-0.75)  # the token 3 versions old is out
    m = finalize_metrics(out.sums)
    assert m["train/stale_masked_fraction"] == 0.25 and m["train/is_dropped_fraction"] == 0.0
    assert m["train/token_staleness/mean"] == 1.5 and m["train/token_staleness/max"] == 3.0
    assert {k: v for k, v in m.items() if "staleness/ratio_" in k} == {
        f"train/token_staleness/ratio_{k}": 0.25 for k in range(4)
    }
    assert policy_loss(logp, **common).loss.item() == near(-1.0)  # unset: every token trains
    assert C.staleness_histogram(torch.tensor([40, 0]), torch.tensor([True, True]))[-1] == 1  # "16 or more"


def test_token_staleness_from_the_versions_a_sample_carries():
    def sample(versions):
        n = len(versions)
        return Sample(
            tokens=torch.zeros(n + 1, dtype=torch.long),
            prompt_len=1,
            loss_mask=torch.tensor([v >= 0 for v in versions]),
            rollout_logprobs=torch.zeros(n),
            advantage=1.0,
            agg_weight=torch.zeros(n, dtype=torch.float64),
            weight_versions=torch.tensor(versions, dtype=torch.int32),
        )

    x = microbatch_extras([sample([3, 3, -1, 4]), sample([5])], actor_version=5)
    assert x["staleness"].tolist() == [2, 2, 0, 1, 0] and x["seq"].tolist() == [0, 0, 0, 0, 1]
    assert token_staleness(torch.tensor([-1, 7]), 7).tolist() == [0, 0]


def test_the_config_names_every_correction_and_checks_its_bounds():
    field = AlgorithmConfig.__dataclass_fields__["off_policy_correction"]
    assert typing.get_args(field.type if not isinstance(field.type, str) else eval(field.type, vars(typing))) == (
        C.CORRECTIONS
    )
    assert {f: getattr(AlgorithmConfig(), f) for f in C.CorrectionParams.__dataclass_fields__} == vars(
        C.CorrectionParams()
    )  # one set of defaults
    cfg = config_from_dict({"algorithm": {"off_policy_correction": "icepop", "icepop_high": 4.0}})
    assert cfg.algorithm.icepop_high == 4.0 and _warn_correction_params(cfg) == []
    with pytest.raises(ConfigError, match="algorithm.off_policy_correction: must be one of .*'m2po'"):
        config_from_dict({"algorithm": {"off_policy_correction": "mis"}})
    with pytest.raises(ConfigError, match="algorithm.icepop_low"):
        config_from_dict({"algorithm": {"icepop_low": 1.5}})
    with pytest.raises(ConfigError, match="algorithm.m2po_tau"):
        config_from_dict({"algorithm": {"m2po_tau": 0.0}})
    with pytest.raises(ConfigError, match="algorithm.max_token_staleness"):
        config_from_dict({"algorithm": {"max_token_staleness": -1}})
    (w,) = _warn_correction_params(config_from_dict({"algorithm": {"off_policy_correction": "tis", "m2po_tau": 0.1}}))
    assert "algorithm.m2po_tau = 0.1 is ignored" in w and "'tis'" in w and "m2po" in w


def test_a_mixed_version_trajectory_reaches_the_loss_with_its_per_token_versions():
    """In-flight updates (``in_place``/``retract``) give one trajectory tokens of several versions: each token's
    version crosses worker -> broker -> actor rank 0 -> a DP rank and becomes its staleness in the loss."""
    from asyncrl.actor.batch import groups_to_samples
    from asyncrl.actor.scatter import flatten, unflatten
    from asyncrl.broker import protocol as P
    from asyncrl.broker.types import Group, PromptItem, Trajectory

    traj = Trajectory(
        [1, 2], [5, 6, 7, 8], [1, 1, 0, 1], [-0.5, -0.5, 0.0, -0.5], reward=1.0, weight_versions=[2, 2, -1, 3],
        min_version=2, max_version=3,
    )  # fmt: skip
    other = Trajectory([1, 2], [9], [1], [-0.1], reward=0.0, weight_versions=[3], min_version=3, max_version=3)
    msg = P.decode(P.finished_groups_frames([(1, [traj, other], False, "")]), allowed=P.WORKER_TYPES)
    _, ((_, got, _, _),) = P.unpack_finished_groups(msg)  # the broker's view
    table, frames = P.pack_groups([Group(1, PromptItem(1, "q"), 0, got, 2, 3)])
    batch = P.decode(P.encode(P.BATCH, {"groups": table}, frames), allowed=P.TO_ACTOR_TYPES)
    actor = P.unpack_groups(batch.body["groups"], batch.blobs)  # the actor's view
    samples = unflatten(*flatten(groups_to_samples(actor, normalize_adv_by_std=False, loss_agg_mode="token_mean")))
    assert samples[0].weight_versions.tolist() == [2, 2, -1, 3]
    x = microbatch_extras(samples, actor_version=4)
    assert x["staleness"].tolist() == [2, 2, 0, 1, 1]
