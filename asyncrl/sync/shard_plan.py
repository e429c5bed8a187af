"""Who sends which bytes in a sharded weight sync (pure: no process groups, no I/O).

Contract
- Input: the actor's parameters as ``ParamMeta`` (its global Megatron name, the pipeline stage holding it, the EP
  rank holding it if it is an expert's under expert parallelism, whether it is TP-sharded, the bytes of one TP shard,
  and the HF tensors it becomes: name, shape, dtype), in model order (stage 0's, then stage 1's, ...; a MoE layer's
  experts in global order), the same list on every actor rank (``asyncrl.actor.shard_source`` builds each stage's
  and each EP rank's from the model's shapes alone, on the meta device, and all-gathers them once), the number of
  senders, the number of pipeline stages ``pp``, the EP size ``ep`` and ``sync.bucket_bytes``.
- Senders, stage-major then EP-major: ``num_senders = TP x ep x pp``; sender ``i`` is TP rank ``i % TP`` of EP
  rank ``(i // TP) % ep`` of stage ``i // (TP x ep)``, in the expert-data-parallel replica that holds actor rank 0
  (``ep = 1``: the data-parallel replica holding actor rank 0; ``ep = pp = 1``: sender i is TP rank i of actor rank
  0's TP group). Every sender holds its stage's dense parameters (the EP ranks are data-parallel replicas of them);
  an expert's parameters only its EP rank's senders do.
- ``plan_shards(params, num_senders=, bucket_bytes=, pp=1, ep=1)`` -> ``ShardPlan``, the same on every rank:
    * each parameter gets ONE owner (a sender index, ``0 .. num_senders - 1``) among the senders that hold it (its
      stage's; an expert's: its EP rank's TP ranks of that stage): the experts' first, then the dense ones, each
      group largest first, to the least loaded of the holders (by HF bytes; ties to the lowest index), so within a
      stage the senders' shares differ by at most the largest parameter's bytes (the EP ranks hold equal experts,
      megatron-core's even split; stages hold what they hold: their totals are not balanced); at ``ep = 1`` no
      parameter is an expert's in this sense and the order is size alone;
    * each sender's parameters, in model order, are cut into buckets of at most ``bucket_bytes`` (a larger
      parameter travels alone; a parameter's HF tensors never straddle two buckets: the owner converts it whole);
    * ONE global bucket order, round-robin over all senders (sender 0's first bucket, sender 1's first, ...): every
      actor rank gathers, and the leader sends the engines their update calls, in that order; the last bucket is
      ``is_last`` (its update call carries the new weight version).
- ``rank_bytes(params, plan, tp=)``: what each sender moves in one sharded sync (bytes received + sent in its own
  TP group's gathers to owners + the bytes it broadcasts), ``funnel_rank_bytes(params, tp=, ...)`` the same for the
  broadcast topology (TP all-gather on every rank, the other stages' tensors and the other EP ranks' experts sent to
  actor rank 0, which broadcasts everything; ``params`` there: actor rank 0's own). These are the figures of
  ``sync/rank0_bytes`` and ``sync/bytes_max_rank``; the sharded sender also counts what it really moved
  (``asyncrl.sync.sharded.SendCounts``) and a test holds the two equal.

    plan = plan_shards(params, num_senders=4, bucket_bytes=512 << 20, pp=2)   # TP 2 x PP 2
    for b in plan.buckets: print(b.owner, b.params, b.is_last)
    rank_bytes(params, plan, tp=2)   # [bytes of sender 0, ..., bytes of sender 3]
    plan_shards(params, num_senders=2, bucket_bytes=512 << 20, ep=2)  # TP 1 x EP 2: each EP rank sends its experts
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class HfMeta:
    """One HF tensor of the update call: what ``bucketing.BucketMeta`` needs, without the data."""

    name: str
    shape: tuple[int, ...]
    dtype: str
    """SGLang's spelling (``bucketing.dtype_name``)"""
    nbytes: int


@dataclass(frozen=True)
class ParamMeta:
    """One Megatron parameter of the actor, as the sync sees it."""

    name: str
    """canonical global Megatron name"""
    sharded: bool
    """split over the TP ranks (gathered to its owner); False: every TP rank holds it whole (no gather)"""
    shard_nbytes: int
    """bytes of one TP rank's piece"""
    hf: tuple[HfMeta, ...]
    """the HF tensors it becomes, in order (empty for the tied output copy, never exported)"""
    stage: int = 0
    """the pipeline stage that holds it (0 without PP)"""
    ep_rank: int | None = None
    """the EP rank that holds it (an expert's, at EP > 1); None: every EP rank holds it (dense, or EP = 1)"""

    @property
    def hf_nbytes(self) -> int:
        return sum(h.nbytes for h in self.hf)


@dataclass(frozen=True)
class PlannedBucket:
    owner: int
    """sender index that gathers, converts and broadcasts it"""
    params: tuple[str, ...]
    """Megatron names, in the order they are gathered and converted"""
    hf: tuple[HfMeta, ...]
    """the update call's tensors, in ``names`` order"""
    is_last: bool = False

    @property
    def nbytes(self) -> int:
        return sum(h.nbytes for h in self.hf)


@dataclass(frozen=True)
class ShardPlan:
    num_senders: int
    """TP x ep x pp, stage-major, then EP-major"""
    owners: dict[str, int]
    """Megatron name -> sender index"""
    buckets: tuple[PlannedBucket, ...]
    """the global order"""
    pp: int = 1
    """pipeline stages (sender ``i`` belongs to stage ``i // (num_senders // pp)``)"""
    ep: int = 1
    """EP ranks per stage (sender ``i`` is EP rank ``(i // tp) % ep``)"""

    @property
    def tp(self) -> int:
        """senders per TP group"""
        return self.num_senders // (self.pp * self.ep)

    def stage_senders(self, stage: int) -> range:
        """the sender indices of one pipeline stage"""
        n = self.tp * self.ep
        return range(stage * n, (stage + 1) * n)

    def tp_peers(self, sender: int) -> range:
        """the senders of ``sender``'s TP group (its own included): those that gather a parameter it owns"""
        first = sender - sender % self.tp
        return range(first, first + self.tp)

    def share_bytes(self) -> list[int]:
        """HF bytes each sender broadcasts."""
        out = [0] * self.num_senders
        for b in self.buckets:
            out[b.owner] += b.nbytes
        return out


def _holders(p: ParamMeta, *, tp: int, pp: int, ep: int) -> range:
    """The senders that hold ``p``: its stage's (an expert's: its EP rank's TP ranks there)."""
    if not 0 <= p.stage < pp:
        raise ValueError(f"{p.name}: stage {p.stage} outside the {pp} pipeline stages")
    first = p.stage * tp * ep
    if p.ep_rank is None:
        return range(first, first + tp * ep)
    if not 0 <= p.ep_rank < ep:
        raise ValueError(f"{p.name}: EP rank {p.ep_rank} outside the {ep} EP ranks")
    first += p.ep_rank * tp
    return range(first, first + tp)


def assign_owners(params: Sequence[ParamMeta], num_senders: int, *, pp: int = 1, ep: int = 1) -> dict[str, int]:
    """The experts' parameters first, then the dense ones, each largest first, to the least loaded sender that holds
    it (HF bytes; ties: lowest index, then model order)."""
    if num_senders < 1:
        raise ValueError(f"a sharded sync needs at least one sender, got {num_senders}")
    if pp < 1 or ep < 1 or num_senders % (pp * ep):
        raise ValueError(f"{num_senders} senders do not split over {pp} pipeline stages x {ep} EP ranks")
    tp = num_senders // (pp * ep)
    load = [0] * num_senders
    owners: dict[str, int] = {}
    order = sorted(range(len(params)), key=lambda i: (params[i].ep_rank is None, -params[i].hf_nbytes, i))
    for i in order:
        s = min(_holders(params[i], tp=tp, pp=pp, ep=ep), key=lambda k: (load[k], k))
        owners[params[i].name] = s
        load[s] += params[i].hf_nbytes
    return owners


def _sender_buckets(params: Sequence[ParamMeta], bucket_bytes: int) -> list[list[ParamMeta]]:
    """Greedy, order-preserving cut of one sender's parameters (whole parameters; one too large goes alone)."""
    out: list[list[ParamMeta]] = []
    cur: list[ParamMeta] = []
    size = 0
    for p in params:
        if not p.hf:
            continue
        if cur and size + p.hf_nbytes > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append(p)
        size += p.hf_nbytes
    if cur:
        out.append(cur)
    return out


def plan_shards(
    params: Sequence[ParamMeta], *, num_senders: int, bucket_bytes: int, pp: int = 1, ep: int = 1
) -> ShardPlan:
    """The plan (see module contract); deterministic in its inputs."""
    if bucket_bytes < 1:
        raise ValueError(f"sync.bucket_bytes must be >= 1, got {bucket_bytes}")
    names = [p.name for p in params]
    if len(set(names)) != len(names):
        raise ValueError("plan_shards: a parameter name appears twice")
    owners = assign_owners(params, num_senders, pp=pp, ep=ep)
    per_sender = [_sender_buckets([p for p in params if owners[p.name] == s], bucket_bytes) for s in range(num_senders)]
    order: list[PlannedBucket] = []
    for k in range(max((len(b) for b in per_sender), default=0)):
        for s in range(num_senders):
            if k < len(per_sender[s]):
                ps = per_sender[s][k]
                order.append(PlannedBucket(s, tuple(p.name for p in ps), tuple(h for p in ps for h in p.hf)))
    if order:
        last = order[-1]
        order[-1] = PlannedBucket(last.owner, last.params, last.hf, is_last=True)
    return ShardPlan(num_senders, owners, tuple(order), pp=pp, ep=ep)


def rank_bytes(params: Sequence[ParamMeta], plan: ShardPlan, *, tp: int) -> list[int]:
    """Bytes each sender receives + sends in one sharded sync: the TP gather of its own parameters (``tp - 1``
    shards in), its shard of every parameter a TP peer owns (one shard out), and its broadcasts (each bucket's HF
    bytes once, whatever the number of engines)."""
    assert plan.tp == tp, f"the plan has {plan.tp} senders per TP group, not TP {tp}"
    out = plan.share_bytes()
    for p in params:
        if not p.sharded or tp == 1 or not p.hf:
            continue
        owner = plan.owners[p.name]
        for s in plan.tp_peers(owner):
            out[s] += (tp - 1) * p.shard_nbytes if s == owner else p.shard_nbytes
    return out


def funnel_rank_bytes(params: Sequence[ParamMeta], *, tp: int, broadcast_bytes: int) -> list[int]:
    """The same for the broadcast topology, per TP rank of actor rank 0's group: every rank all-gathers every
    sharded parameter (``tp - 1`` shards in, its own out to ``tp - 1`` peers); rank 0 also broadcasts
    ``broadcast_bytes`` (the whole model; at PP > 1 it first received the other stages' share of it)."""
    gather = sum(2 * (tp - 1) * p.shard_nbytes for p in params if p.sharded and tp > 1)
    stage_bytes = sum(p.hf_nbytes for p in params)
    received = max(0, broadcast_bytes - stage_bytes)  # the other pipeline stages' tensors, sent to rank 0
    return [gather + received + broadcast_bytes] + [gather] * (tp - 1)
