"""Sharded weight sync (``sync.topology = "sharded"``): every TP rank of actor rank 0's group sends its own share.

Contract
- Why: with the broadcast topology every byte goes through actor rank 0 (TP all-gather, then one broadcast). Here
  the senders are the TP ranks of the TP group holding actor rank 0 (other data-parallel replicas hold copies and
  send nothing); ``asyncrl.sync.shard_plan`` gives each parameter one owner (balanced by bytes) and ONE global
  bucket order, computed identically on every actor rank from the model's shapes (``param_metas``, meta device:
  no data moves to plan). A parameter is gathered over TP to its owner only (``dist.gather``; a replicated one,
  e.g. a norm, is not gathered: every TP rank holds it whole), converted to HF there and broadcast from there.
- Groups: SGLang receives ``update_weights_from_distributed`` by ``broadcast(src=0, group=groups[group_name])``,
  so each sender is rank 0 of its OWN weight-update group, ``<sync.group_name>.r<sender>`` (the engines keep
  groups by name, SGLang's ``_model_update_group`` dict and the CPU engine's ``WeightUpdates.groups``). ``form()``
  (collective on every actor rank): the leader broadcasts the engines; every sender other than the leader picks
  its rendezvous address and a free port, all-gathered to the leader; then group by group, in sender order (SGLang's
  scheduler blocks in a join until it completes, so the joins of two groups must not cross), the sender joins as
  rank 0 on a thread while the leader makes the engines' ``/init_weights_update_group`` calls
  (``WeightSyncGroup.init(root=...)``); the leader's verdict is broadcast after each group. ``recreate()`` =
  destroy every group (the leader asks the engines, each sender drops its end) + ``form()``.
- ``sync(version)`` (collective): the leader pauses the engines and opens their update session
  (``WeightSyncer.pause``); then for each planned bucket, in the global order: its owner's TP group gathers it to
  the owner, the owner queues the bucket's broadcasts on its group, the leader (actor rank 0) writes every engine's
  ``/update_weights_from_distributed`` (``group_name`` of the owner; the last bucket carries the weight version and
  ``/end_weight_update`` rides behind it) and reads the answers, then broadcasts its verdict to every actor rank.
  One bucket at a time, the same order to every engine: an engine runs its updates one at a time (the CPU engine on
  its engine thread; SGLang under ``is_pause_cond`` while paused, under the model-update writer lock otherwise), so
  no owner's collective ever waits on an engine busy with another owner's bucket. Then the leader finishes as the
  broadcast topology does (``WeightSyncer.finish``: version check, flush, resume) and, when due, reads the probes
  back (``asyncrl.sync.verify``: the senders send the leader the rows they sent).
- Failure: any failure the leader sees (an engine's refusal or death, a broadcast of its own that failed, a join)
  becomes the verdict: every rank stops at that bucket (an owner abandons its queued broadcasts), the leader closes
  the engines' sessions and raises; other ranks raise ``FollowerStopped``. ``sync_weights_sharded`` (the
  ``recovery.sync_weights`` of this topology) then lets the leader's ``EngineRecovery`` decide retry or not, and
  all ranks follow that verdict; a retry re-forms the groups when an engine restarted.
- Bytes: ``SendCounts`` counts what this rank received and sent in the gathers and broadcast;
  ``sync/rank0_bytes`` is the leader's count, ``sync/bytes_max_rank`` the plan's busiest sender
  (``shard_plan.rank_bytes``); the broadcast topology reports both too (``funnel_bytes``).
- Same code for NCCL (GPU) and gloo (CPU): the tensors stay on the actor's device; the group's backend is
  ``sync.backend``.

    sharded = ShardedSync(actor, cfg.sync, bcast=bcast_obj, syncer=syncer if rank == 0 else None)
    sharded.form()                                          # every actor rank
    res = sync_weights_sharded(sharded, recovery, bcast=bcast_obj)   # SyncResult on the leader, None elsewhere
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist

from asyncrl.actor.convert import megatron_to_hf, tp_merge
from asyncrl.actor.names import tp_split_dim
from asyncrl.actor.weights import is_tied_output_copy, local_params
from asyncrl.cluster import weight_update_group as _pgmod
from asyncrl.cluster.ports import free_port
from asyncrl.engine.blocking import Call, EngineStepError, Exchange, spawn
from asyncrl.engine.client import confirms_weight_version
from asyncrl.sync import group as _group
from asyncrl.sync.bucketing import BucketMeta, dtype_name, flatten_bucket, tensor_nbytes, update_request
from asyncrl.sync.group import GroupJoinError, WeightSyncGroup, default_master_address
from asyncrl.sync.recovery import SyncAbandoned
from asyncrl.sync.shard_plan import HfMeta, ParamMeta, ShardPlan, funnel_rank_bytes, plan_shards, rank_bytes
from asyncrl.sync.verify import SentRows, verify_sync
from asyncrl.sync.weight_sync import SyncResult, WeightSyncer, send_bucket

log = logging.getLogger(__name__)

# Errors that fail a sync (and that the recovery may retry): an engine's, a join's, a broadcast's.
_SYNC_ERRORS = (EngineStepError, GroupJoinError, RuntimeError)


class FollowerStopped(RuntimeError):
    """On an actor rank other than the leader: the leader's verdict stopped the sync or the group formation."""


def sender_group_name(base: str, sender: int) -> str:
    """The weight-update group of sender ``sender`` (its rank 0)."""
    return f"{base}.r{sender}"


@dataclass
class SendCounts:
    """Bytes this rank moved in one sharded sync."""

    gather_in: int = 0
    gather_out: int = 0
    broadcast: int = 0

    @property
    def total(self) -> int:
        return self.gather_in + self.gather_out + self.broadcast


@torch.no_grad()
def param_metas(model: torch.nn.Module, spec, *, tp: int) -> list[ParamMeta]:
    """The plan's input from the model's shapes alone (meta tensors: the conversion runs without data)."""
    out = []
    for name, p in local_params(model):
        sharded = tp > 1 and tp_split_dim(name) is not None
        local = torch.empty(p.shape, dtype=p.dtype, device="meta")
        full = tp_merge(name, [local] * tp) if sharded else local
        hf = () if is_tied_output_copy(name, spec) else tuple(megatron_to_hf(name, full, spec))
        out.append(
            ParamMeta(
                name=name,
                sharded=sharded,
                shard_nbytes=tensor_nbytes(local),
                hf=tuple(HfMeta(n, tuple(t.shape), dtype_name(t.dtype), tensor_nbytes(t)) for n, t in hf),
            )
        )
    return out


def funnel_bytes(metas: list[ParamMeta], *, tp: int, num_bytes: int) -> tuple[int, int]:
    """``(sync/rank0_bytes, sync/bytes_max_rank)`` of a broadcast-topology sync that sent ``num_bytes``."""
    per_rank = funnel_rank_bytes(metas, tp=tp, broadcast_bytes=num_bytes)
    return per_rank[0], max(per_rank)


def with_bytes(res: SyncResult, rank0_bytes: int, max_rank_bytes: int) -> SyncResult:
    return dataclasses.replace(res, rank0_bytes=rank0_bytes, max_rank_bytes=max_rank_bytes)


class ShardedSync:
    """One actor rank's part in sharded syncs (see module contract). ``syncer`` on the leader only: its group's
    engines are the engines, its settings the sync's."""

    def __init__(self, actor, sync_cfg, *, bcast: Callable[[Any], Any], syncer: Optional[WeightSyncer] = None):
        if getattr(actor, "stage", None) is not None or getattr(actor.experts, "ep", 1) > 1:
            raise ValueError("sync.topology = 'sharded' supports TP (and DP) actors only, not PP or EP")
        self.cfg, self.bcast, self.syncer = sync_cfg, bcast, syncer
        self.is_leader = syncer is not None
        self.model, self.spec, self.tp, self.tp_group = actor.model, actor.spec, actor.tp, actor.tp_group
        self.actor = actor
        self.rank = dist.get_rank()
        assert self.is_leader == (self.rank == 0), "the leader is actor rank 0"
        mine = dist.get_process_group_ranks(self.tp_group) if self.tp > 1 else [self.rank]
        self.senders: list[int] = self.bcast(mine if self.is_leader else None)
        self.sender: Optional[int] = self.senders.index(self.rank) if self.rank in self.senders else None
        self.metas = param_metas(self.model, self.spec, tp=self.tp)
        self.plan: ShardPlan = plan_shards(
            self.metas, num_senders=len(self.senders), bucket_bytes=sync_cfg.bucket_bytes
        )
        self.groups: list[WeightSyncGroup] = []
        """the leader's end of every sender's group (engines' calls; ``groups[0].pg`` is its own)"""
        if self.is_leader:
            g0 = syncer.group
            self.groups = [
                WeightSyncGroup(
                    g0.engines,
                    sync_cfg,
                    group_name=sender_group_name(sync_cfg.group_name, s),
                    master_address=g0._master_address,
                )
                for s in range(len(self.senders))
            ]
        self.pg: Optional[dist.ProcessGroup] = None
        """this sender's own group (its rank 0)"""
        self.counts = SendCounts()
        self.formed = False

    # -- groups ---------------------------------------------------------------------------------------------------

    def _verdict(self, err: Optional[BaseException]) -> None:
        """The leader's outcome to every rank; a failure raises everywhere (the leader: ``err`` itself)."""
        said = self.bcast(None if err is None else f"{type(err).__name__}: {err}")
        if said is None:
            return
        if self.is_leader:
            raise err
        raise FollowerStopped(said)

    def form(self) -> None:
        """Every sender's group, one after the other (collective; see module contract)."""
        urls, world = self.bcast((self.syncer.urls, self.syncer.group.world_size) if self.is_leader else None)
        root = None
        if self.sender not in (None, 0):
            addr = default_master_address(urls)
            root = (addr, free_port(addr))
        roots: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(roots, root)
        for s, r in enumerate(self.senders):
            join = None
            if s == self.sender and not self.is_leader:
                join = spawn(
                    _pgmod.init_weight_update_group,
                    *roots[r],
                    rank=0,
                    world_size=world,
                    group_name=sender_group_name(self.cfg.group_name, s),
                    backend=_group.resolve_backend(self.cfg.backend),
                    timeout_s=self.cfg.join_timeout_s,
                    collective_timeout_s=self.cfg.broadcast_timeout_s,
                    name="sync-join-sender",
                )
            err = None
            if self.is_leader:
                try:
                    self.groups[s].init(root=None if s == 0 else roots[r])
                except GroupJoinError as e:
                    err = GroupJoinError(e.urls, f"group of sender {s} (actor rank {r}): {e}")
            try:
                self._verdict(err)
            except FollowerStopped:
                if join is not None and not join.done():  # waits out its rendezvous timeout (group.py's reason)
                    _group._ABANDONED[join] = time.monotonic() + self.cfg.join_timeout_s
                raise
            if join is not None:
                self.pg = join.result(timeout=self.cfg.join_timeout_s)  # the engines joined: so did it
        if self.is_leader:
            self.syncer.group.pg = self.groups[0].pg  # the syncer's pause/finish/verify use the engines' list only
        self.formed = True

    def destroy(self) -> None:
        """Drop every group: the engines' ends (leader) and each sender's own."""
        for g in self.groups[1:]:
            g.destroy()
        if self.is_leader and self.groups:
            self.groups[0].destroy()
            self.syncer.group.pg = None
        if self.pg is not None:
            _pgmod.destroy_weight_update_group(self.pg)
            self.pg = None
        self.formed = False

    def recreate(self) -> None:
        self.destroy()
        self.form()

    # -- one sync -------------------------------------------------------------------------------------------------

    def _gather(self, b) -> list[tuple[str, torch.Tensor]]:
        """Bucket ``b`` gathered and converted on its owner (its HF tensors, in ``b.hf`` order); [] elsewhere."""
        if self.sender is None:  # another data-parallel replica: holds a copy, sends nothing
            return []
        owner = self.senders[b.owner]
        params = self.actor_params
        out: list[tuple[str, torch.Tensor]] = []
        for name in b.params:
            local = params[name].detach()
            sharded = self.tp > 1 and tp_split_dim(name) is not None
            if self.rank == owner:
                if sharded:
                    shards = [torch.empty_like(local) for _ in range(self.tp)]
                    dist.gather(local.contiguous(), gather_list=shards, dst=owner, group=self.tp_group)
                    self.counts.gather_in += (self.tp - 1) * tensor_nbytes(local)
                    full = tp_merge(name, shards)
                else:
                    full = local.clone()  # never the parameter's own storage
                out.extend(megatron_to_hf(name, full, self.spec))
            elif sharded:
                dist.gather(local.contiguous(), dst=owner, group=self.tp_group)
                self.counts.gather_out += tensor_nbytes(local)
        return out

    def _leader_send(self, k: int, b, tensors, version: str) -> list[Any]:
        """Bucket ``k``: every engine's update call (and, for the last, the end behind it); the broadcast too
        when the leader owns it. The engines' answers."""
        body = update_request(
            BucketMeta(tuple(h.name for h in b.hf), tuple(h.dtype for h in b.hf), tuple(h.shape for h in b.hf)),
            group_name=self.groups[b.owner].group_name,
            flush_cache=self.syncer.pause_mode != "in_place",
            flattened=self.cfg.flattened_bucket,
            weight_version=version if b.is_last else None,
        )
        if b.owner == 0:
            self.counts.broadcast += sum(tensor_nbytes(t) for _, t in tensors)
            return send_bucket(
                self.groups[0],
                tensors,
                body,
                index=k,
                flattened=self.cfg.flattened_bucket,
                step_timeout_s=self.cfg.step_timeout_s,
                end=b.is_last,
            )
        calls = [Call("/update_weights_from_distributed", body, "update_weights_from_distributed")]
        if b.is_last:
            calls.append(Call("/end_weight_update", {}, "end_weight_update", pipelined=True))
        ex = Exchange([(u, calls) for u in self.syncer.urls], timeout_s=self.cfg.step_timeout_s)
        return [a[0] for a in ex.start().wait()]

    def _owner_send(self, tensors) -> list[dist.Work]:
        self.counts.broadcast += sum(tensor_nbytes(t) for _, t in tensors)
        flat = [flatten_bucket(tensors)] if self.cfg.flattened_bucket else [t.contiguous() for _, t in tensors]
        return [_pgmod.broadcast_from_rank0(t, self.pg) for t in flat]

    def sync(self, version: Any) -> Optional[SyncResult]:
        """One sharded sync at ``version`` (collective; see module contract): the leader's ``SyncResult``, None
        elsewhere. Raises the leader's error there, ``FollowerStopped`` elsewhere."""
        assert self.formed, "form() the groups first"
        self.counts = SendCounts()
        self.actor_params = dict(local_params(self.model))
        v = str(version)
        t0 = time.perf_counter()
        sent, err, answers = None, None, []
        if self.is_leader:
            s = self.syncer
            s.num_syncs += 1
            every = self.cfg.verify_interval
            sent = SentRows() if every and (s.num_syncs == 1 or s.num_syncs % every == 0) else None
            try:
                s.pause()
            except _SYNC_ERRORS as e:
                err = e
        due = self.bcast(sent is not None if err is None else None)
        if due is None:
            self._fail(err, version)
        rows = SentRows() if due and self.sender is not None else None
        t1 = time.perf_counter()
        gather_s = transfer_s = 0.0
        for k, b in enumerate(self.plan.buckets):
            tg = time.perf_counter()
            tensors = self._gather(b)
            if rows is not None and tensors:
                for _ in rows.capture([tensors]):
                    pass
            tt = time.perf_counter()
            gather_s += tt - tg
            works: list[dist.Work] = []
            if self.is_leader:
                try:
                    answers = self._leader_send(k, b, tensors, v)
                except (EngineStepError, RuntimeError, dist.DistError) as e:
                    err = e
            elif tensors:
                works = self._owner_send(tensors)
            if self.bcast(None if err is None else repr(err)) is not None:
                self._fail(err, version)  # an owner's queued broadcasts are abandoned with its group
            for w in works:
                w.wait()  # every engine answered success: it has every tensor
            transfer_s += time.perf_counter() - tt
        t2 = time.perf_counter()
        if due:
            got: list[Any] = [None] * dist.get_world_size() if self.is_leader else None
            dist.gather_object(rows.rows if rows is not None else {}, got, dst=0)
            if self.is_leader:
                for r in got:
                    sent.rows.update(r)
        if not self.is_leader:
            return None
        last = self.plan.buckets[-1]
        unconfirmed = [u for u, a in zip(self.syncer.urls, answers) if not confirms_weight_version(a, v)]
        try:
            self.syncer.finish(
                version,
                version_sent=last.is_last,
                flushed=self.syncer.pause_mode != "in_place",
                unconfirmed=unconfirmed,
                ended=True,
            )
        except _SYNC_ERRORS as e:
            self._fail(e, version)
        t3 = time.perf_counter()
        verified = verify_sync(self.syncer.urls, sent, version=version, timeout_s=self.cfg.step_timeout_s)
        per_rank = rank_bytes(self.metas, self.plan, tp=self.tp)
        return SyncResult(
            version=v,
            num_bytes=sum(b.nbytes for b in self.plan.buckets),
            num_buckets=len(self.plan.buckets),
            num_tensors=sum(len(b.hf) for b in self.plan.buckets),
            time_s=t3 - t0,
            pause_s=t1 - t0,
            gather_s=gather_s,
            transfer_s=transfer_s,
            finish_s=t3 - t2,
            verify=verified,
            verify_s=time.perf_counter() - t3,
            rank0_bytes=self.counts.total,
            max_rank_bytes=max(per_rank),
        )

    @staticmethod
    def _named(e: BaseException, version: Any) -> BaseException:
        if isinstance(e, EngineStepError):  # name the training step too, as the broadcast topology does
            return EngineStepError(e.urls, e.step, f"{e.detail} (weight sync to version {version})")
        return e

    def _fail(self, err: Optional[BaseException], version: Any) -> None:
        """Stop this rank's part of a failed sync: the leader closes the engines' sessions and raises ``err``."""
        if self.is_leader:
            self.syncer.close_sessions()
            raise self._named(err, version) from err
        raise FollowerStopped(f"the leader stopped the weight sync to version {version}")


def sync_weights_sharded(sharded: ShardedSync, recovery, *, bcast: Callable[[Any], Any]) -> Optional[SyncResult]:
    """``asyncrl.sync.recovery.sync_weights`` for the sharded topology (collective on every actor rank): re-form the
    groups when an engine restarted, sync, and on a failure let the leader's recovery decide, all ranks together."""
    version = sharded.actor.version
    while True:
        restarted = recovery.restarted() if sharded.is_leader and recovery is not None else None
        res, err = None, None
        try:
            if bcast(restarted is not None or not sharded.formed):
                if restarted is not None:
                    log.warning("engine restart(s) seen: re-forming the sharded weight-sync groups")
                sharded.recreate()
                if restarted is not None:
                    recovery.joined = restarted
            res = sharded.sync(version)
        except FollowerStopped:
            pass
        except _SYNC_ERRORS as e:
            if recovery is None or not sharded.is_leader:
                raise
            err = e
        verdict = None
        if err is not None:
            verdict = "retry" if recovery.after_failure(err) else "abandon"
        elif sharded.is_leader and recovery is not None:
            recovery.after_sync()
        verdict = bcast(verdict)
        if verdict is None:
            return res
        if verdict == "abandon":
            raise SyncAbandoned(
                f"weight sync at version {version} abandoned: the run is stopping" + (f" ({err})" if err else "")
            )
        log.info("retrying the sharded weight sync at version %s", version)
