"""Sharded weight sync (``sync.topology = "sharded"``): every TP rank of every pipeline stage (and every EP rank) of
actor rank 0's data-parallel (expert-data-parallel) replica sends its own share.

Contract
- Why: with the broadcast topology every byte goes through actor rank 0 (TP all-gather, the other pipeline stages'
  tensors and the other EP ranks' experts sent to it, then one broadcast). Here the senders are the TP ranks of
  every pipeline stage of the data-parallel replica holding actor rank 0 (other replicas hold copies and send
  nothing), and with expert parallelism those of every EP rank of its expert-data-parallel replica,
  ``source.senders``, stage-major then EP-major; ``asyncrl.sync.shard_plan`` gives each parameter one owner among the
  senders that hold it (an expert's: its EP rank's TP ranks; a dense one: any sender of its stage; balanced by
  bytes within the stage) and ONE global bucket order, computed identically on every actor rank from the model's
  shapes (every stage's and EP rank's, all-gathered once by the source). The actor's side
  (``asyncrl.actor.shard_source.ShardSource``, the ``source`` here) gathers a parameter over its owner's TP group to
  the owner only (not all-gathered), converts it to HF there, and the owner broadcasts it: no tensor crosses from
  one stage or EP rank to another.
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
  the owner (the other stages' ranks sit it out), the owner queues the bucket's broadcasts on its group, the leader
  (actor rank 0) writes every engine's ``/update_weights_from_distributed`` (``group_name`` of the owner; the last
  bucket carries the weight version and ``/end_weight_update`` rides behind it) and reads the answers, then
  broadcasts its verdict to every actor rank.
  One bucket at a time, the same order to every engine: an engine runs its updates one at a time (the CPU engine on
  its engine thread; SGLang under ``is_pause_cond`` while paused, under the model-update writer lock otherwise), so
  no owner's collective ever waits on an engine busy with another owner's bucket. Then the leader finishes as the
  broadcast topology does (``WeightSyncer.finish``: version check, flush, resume) and, when due, reads the probes
  back (``asyncrl.sync.verify``: the senders send the leader the rows they sent).
- Failure: any failure the leader sees (an engine's refusal or death, a broadcast of its own that failed, a join)
  becomes the verdict: every rank stops at that bucket (an owner abandons its queued broadcasts), the leader closes
  the engines' sessions and raises; other ranks raise ``FollowerStopped``. ``sync_weights_sharded`` (the
  ``recovery.sync_weights`` of this topology) then lets the leader's ``EngineRecovery`` decide retry or not, and
  all ranks follow that verdict; a retry re-forms the groups when an engine restarted. An owner waits on its own
  broadcasts only after the verdict said every engine answered success (they have every tensor by then).
- Limits: one bucket in flight at a time (no overlap of two owners' broadcasts; each bucket costs one small object
  broadcast over the actor ranks for the verdict: a stage's sender waits while another stage's bucket is sent), and
  every engine TP rank still receives whole tensors (no per-slice receive).
- Bytes: ``bytes_moved()`` is what this rank received and sent in the gathers and broadcast in the last sync;
  ``sync/rank0_bytes`` is the leader's, ``sync/bytes_max_rank`` the plan's busiest sender
  (``shard_plan.rank_bytes``); the broadcast topology reports both too (``funnel_bytes``).
- Same code for NCCL (GPU) and gloo (CPU): the tensors stay on the actor's device; the group's backend is
  ``sync.backend``.

    sharded = ShardedSync(ShardSource(actor), cfg.sync, bcast=bcast_obj, syncer=syncer if rank == 0 else None)
    sharded.form()                                                   # every actor rank
    res = sync_weights_sharded(sharded, recovery, bcast=bcast_obj)   # SyncResult on the leader, None elsewhere
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any, Optional

import torch.distributed as dist

from asyncrl.cluster import weight_update_group as _pgmod
from asyncrl.cluster.ports import free_port
from asyncrl.engine.blocking import Call, EngineStepError, Exchange, spawn
from asyncrl.engine.client import confirms_weight_version
from asyncrl.sync import group as _group
from asyncrl.sync.bucketing import BucketMeta, flatten_bucket, tensor_nbytes, update_request
from asyncrl.sync.group import GroupJoinError, WeightSyncGroup, default_master_address
from asyncrl.sync.recovery import follow_verdict
from asyncrl.sync.shard_plan import ParamMeta, PlannedBucket, ShardPlan, funnel_rank_bytes, plan_shards, rank_bytes
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


def funnel_bytes(metas: list[ParamMeta], *, tp: int, num_bytes: int) -> tuple[int, int]:
    """``(sync/rank0_bytes, sync/bytes_max_rank)`` of a broadcast-topology sync that sent ``num_bytes``."""
    per_rank = funnel_rank_bytes(metas, tp=tp, broadcast_bytes=num_bytes)
    return per_rank[0], max(per_rank)


def with_bytes(res: SyncResult, rank0_bytes: int, max_rank_bytes: int) -> SyncResult:
    return dataclasses.replace(res, rank0_bytes=rank0_bytes, max_rank_bytes=max_rank_bytes)


class ShardedSync:
    """One actor rank's part in sharded syncs (see module contract). ``source``: the actor's weights
    (``ShardSource``: ``metas``, ``senders``, ``pp``, ``ep``, ``version``, ``begin()``, ``gather(bucket, owner=)``,
    ``counts``);
    ``syncer`` on the leader only: its group's engines are the engines, its settings the sync's."""

    def __init__(self, source, sync_cfg, *, bcast: Callable[[Any], Any], syncer: Optional[WeightSyncer] = None):
        self.source, self.cfg, self.bcast, self.syncer = source, sync_cfg, bcast, syncer
        self.is_leader = syncer is not None
        self.rank = dist.get_rank()
        assert self.is_leader == (self.rank == 0), "the leader is actor rank 0"
        self.senders: list[int] = list(source.senders)
        """global ranks of the senders: every stage's (and EP rank's) TP ranks in actor rank 0's replica"""
        self.sender: Optional[int] = self.senders.index(self.rank) if self.rank in self.senders else None
        self.plan: ShardPlan = plan_shards(
            source.metas, num_senders=len(self.senders), bucket_bytes=sync_cfg.bucket_bytes, pp=source.pp, ep=source.ep
        )
        self.groups: list[WeightSyncGroup] = []
        """the leader's end of every sender's group (the engines' calls; ``groups[0].pg`` is its own)"""
        if self.is_leader:
            g0 = syncer.group
            self.groups = [
                WeightSyncGroup(
                    g0.engines,
                    sync_cfg,
                    group_name=sender_group_name(sync_cfg.group_name, s),
                    master_address=g0.master_address,
                    control_timeout_s=g0.control_timeout_s,
                )
                for s in range(len(self.senders))
            ]
        self.pg: Optional[dist.ProcessGroup] = None
        """this sender's own group (its rank 0), on a sender other than the leader"""
        self.broadcast_bytes = 0
        self.formed = False

    def bytes_moved(self) -> int:
        """What this rank received + sent in the last sync: its TP gathers and its broadcasts."""
        return self.source.counts.received + self.source.counts.sent + self.broadcast_bytes

    # -- groups ---------------------------------------------------------------------------------------------------

    def _verdict(self, err: Optional[BaseException]) -> None:
        """The leader's outcome to every rank; a failure raises everywhere (the leader: ``err`` itself)."""
        said = self.bcast(None if err is None else f"{type(err).__name__}: {err}")
        if said is None:
            return
        if self.is_leader:
            raise err
        raise FollowerStopped(said)

    def _join(self, s: int, root: tuple[str, int], world: int):
        """Sender ``s`` joins its group as rank 0, on a thread (the engines join through the leader's calls)."""
        return spawn(
            _pgmod.init_weight_update_group,
            *root,
            rank=0,
            world_size=world,
            group_name=sender_group_name(self.cfg.group_name, s),
            backend=_group.resolve_backend(self.cfg.backend),
            timeout_s=self.cfg.join_timeout_s,
            collective_timeout_s=self.cfg.broadcast_timeout_s,
            name="sync-join-sender",
        )

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
            join = self._join(s, roots[r], world) if s == self.sender and not self.is_leader else None
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
        self.formed = True

    def destroy(self) -> None:
        """Drop every group: the engines' ends and the leader's (leader), each other sender's own."""
        for g in self.groups:
            g.destroy()
        if self.pg is not None:
            _pgmod.destroy_weight_update_group(self.pg)
            self.pg = None
        self.formed = False

    def recreate(self) -> None:
        self.destroy()
        self.form()

    # -- one sync -------------------------------------------------------------------------------------------------

    def _leader_send(self, k: int, b: PlannedBucket, tensors, version: str) -> list[Any]:
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
            self.broadcast_bytes += sum(tensor_nbytes(t) for _, t in tensors)
            send = dict(flattened=self.cfg.flattened_bucket, step_timeout_s=self.cfg.step_timeout_s, end=b.is_last)
            return send_bucket(self.groups[0], tensors, body, index=k, **send)
        calls = [Call("/update_weights_from_distributed", body, "update_weights_from_distributed")]
        if b.is_last:
            calls.append(Call("/end_weight_update", {}, "end_weight_update", pipelined=True))
        ex = Exchange([(u, calls) for u in self.syncer.urls], timeout_s=self.cfg.step_timeout_s)
        return [a[0] for a in ex.start().wait()]

    def _owner_send(self, tensors) -> list[dist.Work]:
        """A sender other than the leader queues its bucket's broadcasts on its own group."""
        self.broadcast_bytes += sum(tensor_nbytes(t) for _, t in tensors)
        flat = [flatten_bucket(tensors)] if self.cfg.flattened_bucket else [t.contiguous() for _, t in tensors]
        return [_pgmod.broadcast_from_rank0(t, self.pg) for t in flat]

    def _start(self, version: Any) -> tuple[bool, Optional[SentRows], Optional[SentRows]]:
        """The leader pauses the engines and opens their sessions; every rank learns whether the read-back is due.
        Returns that, the leader's rows of everything sent and this sender's own rows (each None when not due)."""
        self.source.begin()
        self.broadcast_bytes = 0
        sent, err = None, None
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
        return due, sent, (SentRows() if due and self.sender is not None else None)

    def _push(self, version: Any, rows: Optional[SentRows]) -> tuple[list[Any], float, float]:
        """Every planned bucket, in the global order (see module contract). Returns the last bucket's answers (the
        leader's), the seconds in gathers and in the sending."""
        v, answers, err = str(version), [], None
        gather_s = transfer_s = 0.0
        for k, b in enumerate(self.plan.buckets):
            tg = time.perf_counter()
            tensors = self.source.gather(b, owner=self.senders[b.owner]) if self.sender is not None else []
            if rows is not None and tensors:
                for _ in rows.capture([tensors]):  # its first rows, for the read-back
                    pass
            tt = time.perf_counter()
            gather_s += tt - tg
            works: list[dist.Work] = []
            if self.is_leader:
                try:
                    answers = self._leader_send(k, b, tensors, v)
                except _SYNC_ERRORS as e:
                    err = e
            elif tensors:
                works = self._owner_send(tensors)
            if self.bcast(None if err is None else repr(err)) is not None:
                self._fail(err, version)  # an owner's queued broadcasts are abandoned with its group
            for w in works:
                w.wait()  # every engine answered success: it has every tensor
            transfer_s += time.perf_counter() - tt
        return answers, gather_s, transfer_s

    def sync(self, version: Any) -> Optional[SyncResult]:
        """One sharded sync at ``version`` (collective; see module contract): the leader's ``SyncResult``, None
        elsewhere. Raises the leader's error there, ``FollowerStopped`` elsewhere."""
        assert self.formed, "form() the groups first"
        t0 = time.perf_counter()
        due, sent, rows = self._start(version)
        t1 = time.perf_counter()
        answers, gather_s, transfer_s = self._push(version, rows)
        t2 = time.perf_counter()
        if due:  # every rank knows it is due (collective): the senders' rows to the leader
            got: Optional[list[Any]] = [None] * dist.get_world_size() if self.is_leader else None
            dist.gather_object(rows.rows if rows is not None else {}, got, dst=0)
            for r in got or []:
                sent.rows.update(r)
        if not self.is_leader:
            return None
        v = str(version)
        unconfirmed = [u for u, a in zip(self.syncer.urls, answers) if not confirms_weight_version(a, v)]
        flushed = self.syncer.pause_mode != "in_place"
        try:
            self.syncer.finish(version, version_sent=True, flushed=flushed, unconfirmed=unconfirmed, ended=True)
        except _SYNC_ERRORS as e:
            self._fail(e, version)
        t3 = time.perf_counter()
        verified = verify_sync(self.syncer.urls, sent, version=version, timeout_s=self.cfg.step_timeout_s)
        buckets = self.plan.buckets
        return SyncResult(
            version=v,
            num_bytes=sum(b.nbytes for b in buckets),
            num_buckets=len(buckets),
            num_tensors=sum(len(b.hf) for b in buckets),
            time_s=t3 - t0,
            pause_s=t1 - t0,
            gather_s=gather_s,
            transfer_s=transfer_s,
            finish_s=t3 - t2,
            verify=verified,
            verify_s=time.perf_counter() - t3,
            rank0_bytes=self.bytes_moved(),
            max_rank_bytes=max(rank_bytes(self.source.metas, self.plan, tp=self.plan.tp)),
        )

    def _fail(self, err: Optional[BaseException], version: Any) -> None:
        """Stop this rank's part of a failed sync: the leader closes the engines' sessions and raises ``err`` (named
        with the version, as the broadcast topology does); the others raise ``FollowerStopped``."""
        if not self.is_leader:
            raise FollowerStopped(f"the leader stopped the weight sync to version {version}")
        self.syncer.close_sessions()
        if isinstance(err, EngineStepError):
            raise EngineStepError(err.urls, err.step, f"{err.detail} (weight sync to version {version})") from err
        raise err


def sync_weights_sharded(sharded: ShardedSync, recovery, *, bcast: Callable[[Any], Any]) -> Optional[SyncResult]:
    """``asyncrl.sync.recovery.sync_weights`` for the sharded topology (collective on every actor rank): re-form the
    groups when an engine restarted, sync, and on a failure let the leader's recovery decide, all ranks together."""
    version = sharded.source.version
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
        if follow_verdict(bcast(verdict), version=version, err=err):
            return res
