"""The sharded sync's plan (``asyncrl.sync.shard_plan``): owners balanced by bytes, one global bucket order, bytes per
rank, with pipeline stages (owners within a parameter's stage); the plan's input from a real model's shapes
(``shard_source.param_metas``); the ``sync.topology`` config rule."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from asyncrl.sync.shard_plan import HfMeta, ParamMeta, funnel_rank_bytes, plan_shards, rank_bytes


def _param(name: str, nbytes: int, *, sharded: bool = True, tp: int = 2, stage: int = 0) -> ParamMeta:
    return ParamMeta(
        name=name,
        sharded=sharded,
        shard_nbytes=nbytes // tp if sharded else nbytes,
        hf=(HfMeta(f"hf.{name}", (nbytes // 4,), "float32", nbytes),),
        stage=stage,
    )


def _model() -> list[ParamMeta]:
    return [
        _param("embedding", 4000),
        *(_param(f"layer{i}.qkv", 1200) for i in range(4)),
        *(_param(f"layer{i}.norm", 40, sharded=False) for i in range(4)),
        *(_param(f"layer{i}.fc1", 2400) for i in range(4)),
        _param("head", 4000),
    ]


def test_owners_are_balanced_by_bytes_and_every_parameter_is_sent_once():
    params = _model()
    plan = plan_shards(params, num_senders=2, bucket_bytes=3000)
    sent = [h.name for b in plan.buckets for h in b.hf]
    assert sorted(sent) == sorted(h.name for p in params for h in p.hf)  # each once
    share = plan.share_bytes()
    assert abs(share[0] - share[1]) <= max(p.hf_nbytes for p in params)
    assert sum(share) == sum(p.hf_nbytes for p in params)
    for b in plan.buckets:
        assert b.nbytes <= 3000 or len(b.params) == 1  # a larger parameter travels alone
        assert all(plan.owners[n] == b.owner for n in b.params)


def test_global_order_alternates_owners_and_only_the_final_bucket_is_last():
    plan = plan_shards(_model(), num_senders=2, bucket_bytes=3000)
    owners = [b.owner for b in plan.buckets]
    k = min(owners.count(0), owners.count(1))
    assert owners[: 2 * k] == [0, 1] * k  # round-robin while both have buckets
    assert [b.is_last for b in plan.buckets] == [False] * (len(owners) - 1) + [True]


def test_the_plan_is_deterministic_and_a_single_sender_owns_everything():
    a = plan_shards(_model(), num_senders=3, bucket_bytes=5000)
    assert a == plan_shards(_model(), num_senders=3, bucket_bytes=5000)
    one = plan_shards(_model(), num_senders=1, bucket_bytes=5000)
    assert set(one.owners.values()) == {0}
    with pytest.raises(ValueError, match="sender"):
        plan_shards(_model(), num_senders=0, bucket_bytes=5000)


def test_rank0_moves_half_the_bytes_of_the_funnel_at_tp2():
    params = [p for p in _model() if p.sharded]  # every parameter TP-split: the exact 1/2
    total = sum(p.hf_nbytes for p in params)
    funnel = funnel_rank_bytes(params, tp=2, broadcast_bytes=total)
    assert funnel == [2 * total, total]  # rank 0: all-gather in + out, then broadcast everything
    plan = plan_shards(params, num_senders=2, bucket_bytes=3000)
    per_rank = rank_bytes(params, plan, tp=2)
    assert sum(per_rank) == 2 * total  # the same gather traffic, the broadcast split
    assert per_rank[0] <= 0.55 * funnel[0] and max(per_rank) <= 0.55 * funnel[0]


def _pp_model(pp: int = 2, tp: int = 2) -> list[ParamMeta]:
    """Stage 0: the embedding and the first layers; the last stage: the rest, the final norm and the head."""
    per_stage = 4 // pp
    out = [_param("embedding", 4000, tp=tp)]
    for i in range(4):
        st = i // per_stage
        out += [
            _param(f"layer{i}.qkv", 1200 + 400 * i, tp=tp, stage=st),
            _param(f"layer{i}.fc1", 2400, tp=tp, stage=st),
        ]
        out.append(_param(f"layer{i}.norm", 40, sharded=False, tp=tp, stage=st))
    return out + [
        _param("final_norm", 40, sharded=False, tp=tp, stage=pp - 1),
        _param("head", 4000, tp=tp, stage=pp - 1),
    ]


def _assert_balanced_per_stage_and_complete(plan, params, *, pp: int) -> None:
    """Each stage's senders share its bytes, at most one parameter apart; every tensor is sent once."""
    share = plan.share_bytes()
    for st in range(pp):
        mine = [p for p in params if p.stage == st]
        got = [share[s] for s in plan.stage_senders(st)]
        assert sum(got) == sum(p.hf_nbytes for p in mine)
        assert max(got) - min(got) <= max(p.hf_nbytes for p in mine)  # balanced within the stage
    sent = [h.name for b in plan.buckets for h in b.hf]
    assert sorted(sent) == sorted(h.name for p in params for h in p.hf)  # every tensor once


@pytest.mark.parametrize("tp,pp", [(1, 2), (2, 2), (2, 4), (3, 2)])
def test_pp_owners_sit_in_the_parameters_stage_balanced_within_it(tp, pp):
    params = _pp_model(pp=pp, tp=tp)
    plan = plan_shards(params, num_senders=tp * pp, bucket_bytes=3000, pp=pp)
    assert plan.tp == tp and plan.pp == pp
    for p in params:  # sender i is TP rank i % tp of stage i // tp
        assert plan.owners[p.name] // tp == p.stage, p
        assert plan.owners[p.name] in plan.stage_senders(p.stage)
    _assert_balanced_per_stage_and_complete(plan, params, pp=pp)
    stage_of = {p.name: p.stage for p in params}
    for b in plan.buckets:
        assert {stage_of[n] for n in b.params} == {b.owner // tp}  # a bucket never spans two stages
    assert len({b.owner for b in plan.buckets}) == tp * pp  # every sender of every stage sends
    # ONE global order: round-robin over all senders while each has buckets, only the final bucket is last
    owners = [b.owner for b in plan.buckets]
    k = min(owners.count(s) for s in range(tp * pp))
    assert owners[: tp * pp * k] == list(range(tp * pp)) * k
    assert [b.is_last for b in plan.buckets] == [False] * (len(owners) - 1) + [True]
    assert plan == plan_shards(list(params), num_senders=tp * pp, bucket_bytes=3000, pp=pp)  # shapes alone decide


def test_pp_bytes_stay_in_the_stage_and_rank0_is_below_the_funnel():
    tp, pp = 2, 2
    params = _pp_model(pp=pp, tp=tp)
    plan = plan_shards(params, num_senders=tp * pp, bucket_bytes=3000, pp=pp)
    per_rank = rank_bytes(params, plan, tp=tp)
    for st in range(pp):  # each stage's gathers move that stage's shards only
        mine = [p for p in params if p.stage == st]
        gather = sum(2 * (tp - 1) * p.shard_nbytes for p in mine if p.sharded)
        assert sum(per_rank[s] for s in plan.stage_senders(st)) == gather + sum(p.hf_nbytes for p in mine)
    total = sum(p.hf_nbytes for p in params)
    funnel = funnel_rank_bytes([p for p in params if p.stage == 0], tp=tp, broadcast_bytes=total)
    assert per_rank[0] < 0.5 * funnel[0] and max(per_rank) < 0.5 * funnel[0]
    one = plan_shards(params, num_senders=pp, bucket_bytes=3000, pp=pp)  # TP 1: no gather, each stage its own
    assert rank_bytes(params, one, tp=1) == [sum(p.hf_nbytes for p in params if p.stage == st) for st in range(pp)]


def test_pp_plan_refuses_a_stage_it_has_no_sender_for():
    with pytest.raises(ValueError, match="stage 1 outside"):
        plan_shards(_pp_model(pp=2), num_senders=2, bucket_bytes=3000, pp=1)
    with pytest.raises(ValueError, match="pipeline stages"):
        plan_shards(_pp_model(pp=2), num_senders=3, bucket_bytes=3000, pp=2)


def test_replicated_parameters_and_the_tied_copy_cost_no_gather():
    norm = _param("norm", 40, sharded=False)
    tied = ParamMeta(name="output_layer.weight", sharded=True, shard_nbytes=2000, hf=())
    plan = plan_shards([norm, tied], num_senders=2, bucket_bytes=100)
    assert [b.params for b in plan.buckets] == [("norm",)]
    assert sum(rank_bytes([norm, tied], plan, tp=2)) == 40


def _moe_model(*, pp: int, tp: int, ep: int, experts: int = 8) -> list[ParamMeta]:
    """``_pp_model``'s dense parameters and, in every layer, ``experts`` experts (fc1 + fc2), split evenly over the
    EP ranks as megatron-core does (EP rank r holds experts ``[r * n, (r + 1) * n)``)."""
    out = []
    n = experts // ep
    for p in _pp_model(pp=pp, tp=tp):
        out.append(p)
        if p.name.endswith(".norm"):  # after each layer's dense part: its experts, in global order
            for e in range(experts):
                for k, nbytes in (("fc1", 1600), ("fc2", 800)):
                    name = f"{p.name[: -len('.norm')]}.expert{e}.{k}"
                    out.append(dataclasses.replace(_param(name, nbytes, tp=tp, stage=p.stage), ep_rank=e // n))
    if ep == 1:
        out = [dataclasses.replace(p, ep_rank=None) for p in out]
    return out


@pytest.mark.parametrize("tp,pp,ep", [(1, 1, 2), (1, 1, 4), (1, 2, 2), (2, 1, 2), (2, 2, 2)])
def test_ep_experts_are_owned_by_a_holder_in_one_global_order_balanced(tp, pp, ep):
    params = _moe_model(pp=pp, tp=tp, ep=ep)
    n = tp * ep * pp
    plan = plan_shards(params, num_senders=n, bucket_bytes=3000, pp=pp, ep=ep)
    assert (plan.tp, plan.ep, plan.pp) == (tp, ep, pp)
    for p in params:  # sender i: TP rank i % tp of EP rank (i // tp) % ep of stage i // (tp * ep)
        o = plan.owners[p.name]
        assert o in plan.stage_senders(p.stage), p
        if p.ep_rank is not None:  # an expert only on a sender of the EP rank that holds it
            assert (o // tp) % ep == p.ep_rank and o // (tp * ep) == p.stage, (p, o)
    dense_owners = {plan.owners[p.name] for p in params if p.ep_rank is None}
    assert {(o // tp) % ep for o in dense_owners} == set(range(ep))  # the dense share spreads over the EP ranks
    _assert_balanced_per_stage_and_complete(plan, params, pp=pp)
    ep_of = {p.name: p.ep_rank for p in params}
    for b in plan.buckets:  # a bucket's experts all sit on its owner's EP rank
        assert {ep_of[x] for x in b.params} <= {None, (b.owner // tp) % ep}
    owners = [b.owner for b in plan.buckets]
    assert set(owners) == set(range(n))  # every sender sends
    k = min(owners.count(s) for s in range(n))
    assert owners[: n * k] == list(range(n)) * k  # ONE global order, round-robin
    assert [b.is_last for b in plan.buckets] == [False] * (len(owners) - 1) + [True]
    assert plan == plan_shards(list(params), num_senders=n, bucket_bytes=3000, pp=pp, ep=ep)  # shapes alone decide


def test_ep_rank0_moves_less_than_the_funnel_and_no_expert_byte_is_gathered_across_ep():
    tp, pp, ep = 1, 1, 2
    params = _moe_model(pp=pp, tp=tp, ep=ep)
    plan = plan_shards(params, num_senders=ep, bucket_bytes=3000, ep=ep)
    per_rank = rank_bytes(params, plan, tp=tp)
    total = sum(p.hf_nbytes for p in params)
    assert per_rank == plan.share_bytes() and sum(per_rank) == total  # TP 1: each byte broadcast once, no gather
    rank0_own = [p for p in params if p.ep_rank in (None, 0)]
    funnel = funnel_rank_bytes(rank0_own, tp=tp, broadcast_bytes=total)
    assert funnel[0] == total + sum(p.hf_nbytes for p in params if p.ep_rank == 1)  # receives EP 1's, sends all
    assert max(per_rank) <= 0.55 * total < 0.4 * funnel[0]
    # TP 2 x EP 2: each TP group's gathers move its own owners' shards only
    params = _moe_model(pp=1, tp=2, ep=2)
    plan = plan_shards(params, num_senders=4, bucket_bytes=3000, ep=2)
    per_rank = rank_bytes(params, plan, tp=2)
    for first in (0, 2):
        mine = [p for p in params if plan.owners[p.name] in plan.tp_peers(first)]
        gather = sum(2 * p.shard_nbytes for p in mine if p.sharded)
        assert per_rank[first] + per_rank[first + 1] == gather + sum(p.hf_nbytes for p in mine)


def test_ep_plan_refuses_an_expert_of_an_ep_rank_it_has_no_sender_for():
    with pytest.raises(ValueError, match="EP rank 1 outside the 1 EP ranks"):
        plan_shards(_moe_model(pp=1, tp=1, ep=2), num_senders=1, bucket_bytes=3000)
    with pytest.raises(ValueError, match="EP ranks"):
        plan_shards(_moe_model(pp=1, tp=1, ep=2), num_senders=3, bucket_bytes=3000, ep=2)


def test_ep_metas_merge_into_global_expert_order():
    from asyncrl.actor.shard_source import _merge_experts

    def expert(layer: int, e: int, k: int) -> ParamMeta:
        return _param(f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc{k}.weight", 64, tp=1)

    dense = [_param("embedding", 64, tp=1), _param("decoder.layers.0.mlp.router.weight", 64, tp=1)]
    tail = [_param("decoder.layers.1.self_attention.linear_qkv.weight", 64, tp=1)]
    ranks = [
        [*dense, *(expert(0, e, k) for e in range(r * 2, r * 2 + 2) for k in (1, 2)), *tail]
        + [expert(1, e, k) for e in range(r * 2, r * 2 + 2) for k in (1, 2)]
        for r in range(2)
    ]
    merged = [m.name for m in _merge_experts(ranks)]
    want = [m.name for m in dense]
    want += [expert(0, e, k).name for e in range(4) for k in (1, 2)] + [m.name for m in tail]
    want += [expert(1, e, k).name for e in range(4) for k in (1, 2)]
    assert merged == want


def test_param_metas_follow_the_converter_on_a_real_model(tmp_path):
    """The shapes the plan is built from equal what the converter yields for the full tensors."""
    import torch

    from asyncrl.actor.convert import hf_state_to_megatron, megatron_to_hf, tp_merge, tp_shard
    from asyncrl.actor.shard_source import param_metas
    from asyncrl.models.safetensors_io import SafetensorsReader
    from asyncrl.models.spec import ModelSpec
    from asyncrl.models.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "m", arch="qwen2", num_hidden_layers=2, hidden_size=32, intermediate_size=64)
    spec = ModelSpec.from_pretrained(ckpt)

    reader = SafetensorsReader(ckpt)
    mg = hf_state_to_megatron({k: reader.get(k) for k in reader.keys()}, spec, tp=2)

    class _Model(torch.nn.Module):  # this TP rank's shards, named as Megatron names them
        def named_parameters(self, *a, **k):
            return [(n, torch.nn.Parameter(tp_shard(n, t, rank=0, tp=2))) for n, t in mg.items()]

    metas = param_metas(_Model(), spec, tp=2)
    for m in metas:
        shard = tp_shard(m.name, mg[m.name], rank=0, tp=2)
        full = tp_merge(m.name, [shard, tp_shard(m.name, mg[m.name], rank=1, tp=2)]) if m.sharded else shard
        got = [(n, tuple(t.shape), t.numel() * t.element_size()) for n, t in megatron_to_hf(m.name, full, spec)]
        assert got == [(h.name, h.shape, h.nbytes) for h in m.hf], m.name


def test_sharded_topology_takes_pipeline_and_expert_parallelism(tmp_path):
    from asyncrl.config import ConfigError, load_config, validate

    root = Path(__file__).resolve().parents[2]
    ok = load_config(root / "configs/searchr1.toml", ["sync.topology=sharded"])
    validate(ok)  # TP / DP: accepted
    pp = load_config(root / "configs/searchr1.toml", ["sync.topology=sharded", "actor.pipeline_model_parallel_size=2"])
    validate(pp)  # PP: accepted, every stage's TP ranks send
    ep = ["sync.topology=sharded", "actor.expert_model_parallel_size=2", "actor.pipeline_model_parallel_size=2"]
    validate(load_config(root / "configs/searchr1.toml", ep))  # EP: accepted, every EP rank sends its experts
    validate(load_config(root / "configs/searchr1.toml", ep[1:]))  # and with the broadcast topology
    grid = load_config(root / "configs/searchr1.toml", [*ep, "actor.expert_model_parallel_size=64"])
    with pytest.raises(ConfigError, match="actor.expert_model_parallel_size: TP"):
        validate(grid)  # the experts' grid must still divide the actor ranks
    with pytest.raises(ConfigError, match="sync.topology"):
        load_config(root / "configs/searchr1.toml", ["sync.topology=ring"])
