# long: the sync's whole contract (steps 1-8, topologies, delta) is one docstring beside the one class that runs it
"""One weight sync: pause the engines, broadcast the actor's buckets, bump the version, resume.

Contract
- Wires: the actor (rank 0 of the weight-sync group; hands in an iterable of buckets, each a list of
  ``(hf_name, full unsharded tensor)``), the engines (HTTP control + the group of
  ``asyncrl.sync.group``), and optionally the broker (``SyncHooks``: ``sync_begin(mode)`` and
  ``sync_end(version)``; absent in tests).
- The sequence of ``WeightSyncer.sync(buckets, version)``, every HTTP step sent to all engines at
  once, each call bounded by ``sync.step_timeout_s`` and failing with ``EngineStepError`` naming
  the engine(s) and the step. Steps 2-3 run per engine in order (an engine's begin is pipelined behind
  its pause: written with it on one connection, run by the engine once the pause answered, HTTP/1.1
  answering in order); step 6's calls go to every engine at once. The calls are made from the sync's
  own thread (``blocking.Exchange``: requests written at once, answers read as they come), with no
  thread hand-off on the critical path: the control calls are the fixed cost of a sync (only the
  drain's load polling runs on the syncer's ``call_pool.CallPool``);
  ``/continue_generation`` goes out only once every engine passed the version check:
    1. ``hooks.sync_begin(mode)``
    2. pause: ``retract`` / ``in_place`` / ``abort`` -> ``POST /pause_generation {mode}``;
       ``drain`` -> wait until every engine reports no running and no queued request (the broker
       stopped issuing and workers hold new turns after ``sync_begin``), then a ``retract`` pause
       as a guard so nothing can start during the update; a request that still slipped in (it was
       on the wire) is seen in the load re-read after the pause: resume, drain again.
    3. ``POST /begin_weight_update``. Steps 2-3 are written to the engines, then the first bucket is gathered,
       then their answers are read (except under ``drain``): the pause's round trips overlap the actor's work,
       and nothing is broadcast before every engine answered both.
    4. per bucket: ``POST /update_weights_from_distributed`` (``flush_cache = mode != in_place``,
       ``load_format = "flattened_bucket"`` with ``sync.flattened_bucket``) on threads while the
       trainer broadcasts the bucket's tensors from group rank 0 in ``names`` order (or one flat
       uint8 tensor); an engine that fails its call fails the sync at once, not at the group timeout.
       The final bucket (``bucketing.LastBucket``, which ``iter_buckets`` yields) carries
       ``weight_version = str(version)``: SGLang's own field, which the engine applies only once that
       update succeeded, i.e. after every bucket is in; its success answer then says so (SGLang appends
       " Weight version updated to V." to the message: ``engine.client.confirms_weight_version``).
       Step 6's ``/end_weight_update`` is pipelined behind that final update call (one round trip fewer;
       should the update fail, the engine still ends the update, and the sync fails).
       Each update with ``flush_cache = true`` flushes the engine's cache once it succeeded (SGLang
       asserts that flush; the engines are paused, so nothing runs on the old KV).
    5. only when no bucket carried it (a producer that does not mark its last bucket, or no bucket):
       ``POST /update_weight_version {new_version, abort_all_requests: false}``.
    6. ``POST /end_weight_update`` unless it rode behind the final bucket (step 4), alongside it
       ``POST /flush_cache`` unless in_place or the updates already flushed (step 4), and the check that
       ``/model_info.weight_version`` equals the new version on every engine whose update answer did not
       confirm it (all of them after step 5); then ``POST /continue_generation``.
    7. ``hooks.sync_end(version)``
    8. after the first sync and every ``sync.verify_interval``-th: a few parameters read back from every engine
       must equal what was sent (``asyncrl.sync.verify``; ``WeightVerifyError`` names the engine and parameter)
- Invariant: after ``sync`` returns, every engine serves ``str(version)`` and is generating again.
  On an error the engines are left paused, every engine's weight-update session is closed first
  (``close_sessions``: ``/end_weight_update`` to each, its refusal "no weight-update session is open" and a dead
  engine's silence ignored, bounded by ``sync.step_timeout_s``), so a retried sync's begin is accepted: SGLang
  refuses a second begin while a session is open. Then the error propagates (the recovery retries or the run fails).
- Metrics (``SyncResult.metrics()``): ``time/sync_weights`` (whole sync, s) = ``time/sync_control`` (broker hooks,
  the pause/begin/version/end/flush/continue calls: steps 1-3 and 5-7) + ``time/sync_gather`` (time in the bucket
  iterator: the actor's TP gather and HF conversion) + ``time/sync_transfer`` (broadcasts and update calls, with
  the end riding behind the final one); ``time/sync_pause`` (steps 1-3 not hidden behind the first gather) and
  ``time/sync_finish``; ``sync/bytes_per_s``, ``sync/transfer_bytes_per_s``, ``sync/num_bytes``,
  ``sync/num_buckets``; step 8's ``time/sync_verify``, ``sync/verified_params``, ``sync/verify_unsupported``;
  ``sync/rank0_bytes`` and ``sync/bytes_max_rank`` (bytes actor rank 0 / the busiest rank moved; see Topology).

    group = WeightSyncGroup(engines, cfg.sync); group.init()
    syncer = WeightSyncer(group, pause_mode=cfg.rollout.pause_mode, sync_cfg=cfg.sync,
                          hooks=SyncHooks(sync_begin=broker.sync_begin, sync_end=broker.sync_end))
    result = syncer.sync(actor.iter_hf_buckets(cfg.sync.bucket_bytes), version=step)

Delta sync (``sync.delta``): step 4 goes through ``asyncrl.sync.delta_sync`` (changed elements only, checked per
tensor, resent whole on a mismatch; docs/weight_sync.md), the version by step 5. Every sync sends ``sync.wire_dtype``.

Pipeline parallelism: one group still; the actor's ``iter_hf_buckets`` brings every stage's tensors to global
rank 0 (``asyncrl.actor.pipeline.gather_to_rank0``), which pushes them all.

Topology (``sync.topology``): this module is the ``broadcast`` one, every byte through actor rank 0 (``rank0_bytes``:
its TP all-gather + everything it broadcasts). ``sharded`` (``asyncrl.sync.sharded``) reuses this syncer's pause,
``send_bucket`` (the buckets the leader owns), ``finish``, ``close_sessions`` and read-back, while each sender (a TP
rank of each stage, and each EP rank, of rank 0's replica) broadcasts its own share from its own group
``<sync.group_name>.r<k>``, the leader still making every
HTTP call, one bucket at a time in one global order. Both report ``sync/rank0_bytes`` and ``sync/bytes_max_rank``.
"""

from __future__ import annotations

import functools
import itertools
import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Optional

import torch.distributed as dist

from asyncrl.cluster.weight_update_group import broadcast_from_rank0
from asyncrl.config.schema import PAUSE_MODES, SyncConfig
from asyncrl.engine.blocking import Call, EngineStepError, Exchange, engine_load, post_json
from asyncrl.engine.client import confirms_weight_version
from asyncrl.sync.bucketing import Bucket, LastBucket, bucket_meta, flatten_bucket, tensor_nbytes, update_request
from asyncrl.sync.call_pool import CallPool
from asyncrl.sync.delta_sync import DeltaSender, DeltaStats, to_wire, wire_dtype
from asyncrl.sync.group import WeightSyncGroup
from asyncrl.sync.verify import SentRows, VerifyResult, verify_sync

log = logging.getLogger(__name__)

# How often the drain wait re-reads the engines' load; short, the wait is bounded by step_timeout_s.
_DRAIN_POLL_S = 0.05


@dataclass
class SyncHooks:
    """Broker notifications around a sync; both optional (tests run without a broker)."""

    sync_begin: Optional[Callable[[str], Any]] = None
    """Called with the pause mode before anything else; under ``drain`` it must make the broker
    stop issuing and the workers hold new turns."""
    sync_end: Optional[Callable[[Any], Any]] = None
    """Called with the new version after the engines resumed."""


@dataclass(frozen=True)
class PushStats:
    """What ``push_buckets`` sent, and where its time went."""

    num_bytes: int
    num_buckets: int
    num_tensors: int
    gather_s: float
    """seconds waiting on the bucket iterator (the actor's gather and conversion)"""
    transfer_s: float
    """seconds of the broadcasts and the engines' update calls"""
    version_sent: bool = False
    """the last bucket's update call carried the new weight version (and every engine answered success), and the end
    of the update rode behind it (``send_bucket``'s ``end``)"""
    flushed: bool = False
    """every update call carried ``flush_cache = true`` and succeeded: SGLang flushed the cache after it (it
    asserts that flush), so no separate ``/flush_cache`` is needed"""
    version_unconfirmed: tuple[str, ...] = ()
    """engines whose answer to the version-carrying update did not confirm the version
    (``confirms_weight_version``): the finish reads their ``/model_info``"""


@dataclass(frozen=True)
class SyncResult:
    version: str
    num_bytes: int
    num_buckets: int
    num_tensors: int
    time_s: float
    pause_s: float
    gather_s: float
    transfer_s: float
    finish_s: float
    verify: VerifyResult = VerifyResult(checked=0, unsupported=False)
    """what the served-weights check read back (``asyncrl.sync.verify``; nothing when it was not due)"""
    verify_s: float = 0.0
    rank0_bytes: int = 0
    """bytes actor rank 0 received + sent for this sync (its TP gather share and its broadcasts; ``shard_plan``)"""
    max_rank_bytes: int = 0
    """the same for the busiest actor rank"""
    delta: Optional[DeltaStats] = None
    """what a delta sync sent (``sync.delta``; ``asyncrl.sync.delta_sync``)"""

    @property
    def control_s(self) -> float:
        return self.pause_s + self.finish_s

    def metrics(self) -> dict[str, float]:
        return {
            "time/sync_weights": self.time_s,
            "time/sync_control": self.control_s,
            "time/sync_gather": self.gather_s,
            "time/sync_pause": self.pause_s,
            "time/sync_transfer": self.transfer_s,
            "time/sync_finish": self.finish_s,
            "sync/bytes_per_s": self.num_bytes / self.time_s if self.time_s > 0 else 0.0,
            "sync/transfer_bytes_per_s": self.num_bytes / self.transfer_s if self.transfer_s > 0 else 0.0,
            "sync/num_bytes": float(self.num_bytes),
            "sync/num_buckets": float(self.num_buckets),
            "sync/verified_params": float(self.verify.checked),
            "sync/verify_unsupported": float(self.verify.unsupported),
            "time/sync_verify": self.verify_s,
            "sync/rank0_bytes": float(self.rank0_bytes),
            "sync/bytes_max_rank": float(self.max_rank_bytes),
            **(self.delta.metrics() if self.delta is not None else {}),
        }


def _check_works(works: list) -> None:
    """Surface a failed broadcast while waiting for the engines (``wait`` raises if it failed)."""
    for w in works:
        if w.is_completed():
            w.wait()


def send_bucket(
    group: WeightSyncGroup,
    bucket: Bucket,
    body: dict,
    *,
    index: int,
    flattened: bool,
    step_timeout_s: float,
    end: bool = False,
) -> list[Any]:
    """One bucket: every engine's ``/update_weights_from_distributed`` call (``body``) written first (an
    ``Exchange``), then this thread queues the bucket's broadcasts (or its one flat tensor's) from group rank 0
    and reads the answers; returns the update answers (in engine order) once every engine answered success and
    every broadcast completed. With ``end``, each engine's ``/end_weight_update`` is pipelined behind its update
    call (it runs right after the update, and is answered too). ``index`` (the bucket's place in the sync) names it
    in a failure."""
    step = "update_weights_from_distributed"
    calls = [Call("/update_weights_from_distributed", body, step)]
    if end:
        calls.append(Call("/end_weight_update", {}, "end_weight_update", pipelined=True))
    ex = Exchange([(u, calls) for u in group.urls], timeout_s=step_timeout_s).start()
    tensors = [flatten_bucket(bucket)] if flattened else [t.detach().contiguous() for _, t in bucket]
    try:
        works = [broadcast_from_rank0(t, group.pg) for t in tensors]
        answers = ex.wait(poll=functools.partial(_check_works, works))
        for w in works:
            w.wait()  # all engines answered success: they have every tensor
        return [a[0] for a in answers]
    except EngineStepError:
        raise
    except (RuntimeError, dist.DistError) as e:  # our broadcast failed or hit sync.broadcast_timeout_s
        raise EngineStepError(
            group.urls, step, f"broadcast of bucket {index} ({len(bucket)} tensors) failed: {type(e).__name__}: {e}"
        ) from e


def push_buckets(
    group: WeightSyncGroup,
    buckets: Iterable[Bucket],
    *,
    flush_cache: bool,
    flattened: bool,
    step_timeout_s: float,
    weight_version: Optional[str] = None,
) -> PushStats:
    """Send every bucket (``send_bucket``), timing the wait on the bucket iterator (gather) apart from the
    sending (transfer). With ``weight_version``, the final bucket (a ``LastBucket``) sets it on the engines and
    ends the update (``/end_weight_update`` pipelined behind it: ``PushStats.version_sent``); a pipeline stage's push
    passes none (its last bucket is not the model's; the coordinator's ``finish`` ends the update)."""
    if group.pg is None:
        raise RuntimeError(f"weight-sync group {group.group_name!r} is not initialised (call init())")
    num_bytes = num_buckets = num_tensors = 0
    gather_s = transfer_s = 0.0
    it = iter(buckets)
    version_sent = False
    unconfirmed: tuple[str, ...] = ()
    send = functools.partial(send_bucket, group, flattened=flattened, step_timeout_s=step_timeout_s)
    while True:
        t0 = time.perf_counter()
        bucket = next(it, None)  # the actor gathers and converts the next bucket here
        t1 = time.perf_counter()
        gather_s += t1 - t0
        if bucket is None:
            break
        assert not version_sent, "the bucket producer yielded a bucket after its LastBucket"
        version_sent = weight_version is not None and isinstance(bucket, LastBucket)
        body = update_request(
            bucket_meta(bucket),
            group_name=group.group_name,
            flush_cache=flush_cache,
            flattened=flattened,
            weight_version=weight_version if version_sent else None,
        )
        answers = send(bucket, body, index=num_buckets, end=version_sent)
        if version_sent:
            unconfirmed = tuple(
                u for u, a in zip(group.urls, answers) if not confirms_weight_version(a, str(weight_version))
            )
        transfer_s += time.perf_counter() - t1
        num_bytes += sum(tensor_nbytes(t) for _, t in bucket)
        num_buckets += 1
        num_tensors += len(bucket)
    return PushStats(
        num_bytes,
        num_buckets,
        num_tensors,
        gather_s,
        transfer_s,
        version_sent,
        flushed=flush_cache and num_buckets > 0,
        version_unconfirmed=unconfirmed,
    )


class WeightSyncer:
    """Runs syncs against one group's engines (see module contract)."""

    def __init__(
        self,
        group: WeightSyncGroup,
        *,
        pause_mode: str,
        sync_cfg: SyncConfig,
        hooks: Optional[SyncHooks] = None,
    ):
        if pause_mode not in PAUSE_MODES:
            raise ValueError(f"rollout.pause_mode must be one of {PAUSE_MODES}, got {pause_mode!r}")
        self.group = group
        self.pause_mode = pause_mode
        self.cfg = sync_cfg
        self.hooks = hooks or SyncHooks()
        self.calls = CallPool()
        self.num_syncs = 0
        self.delta = DeltaSender(sync_cfg) if sync_cfg.delta else None  # sync.delta: step 4 goes through it

    @property
    def urls(self) -> list[str]:
        return self.group.urls

    def _all(self, path: str, body: Any, step: str) -> list[Any]:
        """``POST path body`` to every engine at once; their answers, in engine order."""
        chains = [(u, [Call(path, body, step)]) for u in self.urls]
        return [a[0] for a in Exchange(chains, timeout_s=self.cfg.step_timeout_s).run()]

    def wait_idle(self) -> None:
        """Poll every engine until none has running or queued requests (``drain``)."""
        t = self.cfg.step_timeout_s
        deadline = time.monotonic() + t
        while True:
            loads = self._loads()
            busy = [u for u, n in zip(self.urls, loads) if n > 0]
            if not busy:
                return
            if time.monotonic() > deadline:
                raise EngineStepError(busy, "drain", f"still has running requests after {t:g} s")
            time.sleep(_DRAIN_POLL_S)

    def _loads(self) -> list[float]:
        t = self.cfg.step_timeout_s
        return self.calls.fan_out(self.urls, lambda u: engine_load(u, timeout_s=t), timeout_s=t + 1, step="drain")

    def _drain(self) -> None:
        """Wait idle, pause (retract) as a guard, re-read the load: a request that was already on
        the wire when the broker stopped issuing may land in between; then resume, drain again."""
        deadline = time.monotonic() + self.cfg.step_timeout_s
        while True:
            self.wait_idle()
            self._all("/pause_generation", {"mode": "retract"}, "pause_generation")
            busy = [u for u, n in zip(self.urls, self._loads()) if n > 0]
            if not busy:
                return
            if time.monotonic() > deadline:
                raise EngineStepError(
                    busy,
                    "drain",
                    "requests keep arriving after the broker stopped "
                    f"issuing (sync_begin); not idle after {self.cfg.step_timeout_s:g} s",
                )
            log.info("drain: %s got a request during the pause; resuming to drain it", busy)
            self._all("/continue_generation", {}, "continue_generation")

    def pause(self) -> None:
        """Steps 1-3: tell the broker, pause (or drain) every engine, begin the weight update. Each
        engine gets its pause and then its begin on one thread (no barrier across engines between
        the two: an engine's begin only needs its own pause)."""
        ex = self._start_pause()
        if ex is not None:
            ex.wait()

    def _start_pause(self) -> Optional[Exchange]:
        """``pause`` up to its answers: the pause-and-begin exchange in flight (``wait`` it), or None when it
        is over already (``drain`` waits on the engines' load, so it runs to the end here)."""
        if self.hooks.sync_begin is not None:
            self.hooks.sync_begin(self.pause_mode)
        # pipelined behind the pause: the engine runs it once the pause answered, one round trip sooner
        begin = Call("/begin_weight_update", {"selector": "all"}, "begin_weight_update", pipelined=True)
        if self.pause_mode == "drain":
            self._drain()
            self._all(begin.path, begin.body, begin.step)
            return None
        pause = Call("/pause_generation", {"mode": self.pause_mode}, "pause_generation")
        return Exchange([(u, [pause, begin]) for u in self.urls], timeout_s=2 * self.cfg.step_timeout_s).start()

    def push(self, buckets: Iterable[Bucket], *, weight_version: Optional[str] = None) -> PushStats:
        """Step 4 on this syncer's group (the last bucket carries ``weight_version`` when given), at the wire dtype;
        with ``sync.delta`` through the delta sender (the version is then set by ``finish``)."""
        if self.delta is not None:
            tp, flush = [e.tp_size for e in self.group.engines], self.pause_mode != "in_place"
            st = self.delta.push(self.urls, buckets, flush_cache=flush, tp_sizes=tp)
            return PushStats(st.bytes_sent, st.num_buckets, st.num_tensors, st.gather_s, st.transfer_s, flushed=flush)
        return push_buckets(
            self.group,
            to_wire(buckets, wire_dtype(self.cfg)),
            flush_cache=self.pause_mode != "in_place",
            flattened=self.cfg.flattened_bucket,
            step_timeout_s=self.cfg.step_timeout_s,
            weight_version=weight_version,
        )

    def finish(
        self,
        version: Any,
        *,
        version_sent: bool = False,
        flushed: bool = False,
        unconfirmed: Optional[Iterable[str]] = None,
        ended: bool = False,
    ) -> None:
        """Steps 5-7: the version bump unless the last bucket carried it (``version_sent``), then every
        engine's end of the update unless it rode behind the last bucket (``ended``), alongside it (the engines are
        paused and every bucket is in: their order does not matter) the flush unless the updates already flushed
        (``flushed``) and the version check of every engine whose update answer did not confirm the version
        (``unconfirmed``; default: every engine), then - once every engine passed the check - resume, and tell the
        broker."""
        v = str(version)
        t = self.cfg.step_timeout_s
        if not version_sent:
            self._all(
                "/update_weight_version", {"new_version": v, "abort_all_requests": False}, "update_weight_version"
            )
            unconfirmed = None  # the version call's answer is not read as a confirmation: check every engine
        unconfirmed = None if unconfirmed is None else set(unconfirmed)
        check_urls = self.urls if unconfirmed is None else [u for u in self.urls if u in unconfirmed]
        chains = [] if ended else [(u, [Call("/end_weight_update", {}, "end_weight_update")]) for u in self.urls]
        if self.pause_mode != "in_place" and not flushed:
            chains += [(u, [Call("/flush_cache", {}, "flush_cache")]) for u in self.urls]
        chains += [(u, [Call("/model_info", None, "model_info", method="GET")]) for u in check_urls]
        answers = Exchange(chains, timeout_s=t).run() if chains else []
        infos = [a[0] for a in answers[len(chains) - len(check_urls) :]]
        wrong = [u for u, i in zip(check_urls, infos) if str(i.get("weight_version")) != v]
        if wrong:
            got = [repr(i.get("weight_version")) for u, i in zip(check_urls, infos) if u in wrong]
            raise EngineStepError(
                wrong,
                "update_weight_version",
                f"/model_info.weight_version is {', '.join(got)}, not {v!r}, after the update",
            )
        if self.delta is not None:
            self.delta.version = v  # every engine holds it now: the next delta sync's base
        self._all("/continue_generation", {}, "continue_generation")
        if self.hooks.sync_end is not None:
            self.hooks.sync_end(version)

    def resume(self, urls: Sequence[str], version: Any) -> None:
        """After a failed sync that the engines at ``urls`` finished by pulling ``version``
        (``EngineRecovery.pull_instead``): resume them and tell the broker the sync is over. The delta sender's base
        is unknown after a failed push already (``version`` None): every engine's next sync is whole."""
        if urls:
            chains = [(u, [Call("/continue_generation", {}, "continue_generation")]) for u in urls]
            Exchange(chains, timeout_s=self.cfg.step_timeout_s).run()
        if self.hooks.sync_end is not None:
            self.hooks.sync_end(version)

    def close_sessions(self) -> list[str]:
        """After a failed sync: ``/end_weight_update`` to every engine at once, each answer ignored (an engine
        whose session was not open refuses, a dead one does not answer); returns what each said, for the log."""
        t = self.cfg.step_timeout_s

        def end(url: str) -> str:
            try:
                post_json(url, "/end_weight_update", {}, timeout_s=t, step="end_weight_update")
            except EngineStepError as e:  # SGLang's "no weight-update session is open" (a 400), or a dead engine
                return f"{url}: {e.detail}"
            return f"{url}: closed"

        try:
            said = self.calls.fan_out(self.urls, end, timeout_s=t + 1, step="end_weight_update")
        except EngineStepError as e:  # the fan-out's own deadline: nothing more to do than say so
            said = [f"not all engines answered: {e}"]
        log.warning("weight sync failed: closing the engines' weight-update sessions (%s)", "; ".join(said))
        return said

    def sync(self, buckets: Iterable[Bucket], version: Any) -> SyncResult:
        """One full sync (module contract steps 1-7); returns its figures. The first bucket is gathered while the
        engines pause (their answers are read after it): the sync's fixed cost hides behind the actor's work."""
        t0 = time.perf_counter()
        self.num_syncs += 1
        n, every = self.num_syncs, self.cfg.verify_interval
        sent = SentRows() if every and (n == 1 or n % every == 0) else None
        try:
            ex = self._start_pause()
            it = iter(buckets if sent is None else sent.capture(buckets))
            tg = time.perf_counter()
            first = next(it, None)  # the actor gathers and converts the first bucket while the engines pause
            first_gather_s = time.perf_counter() - tg
            if ex is not None:
                ex.wait()
            t1 = time.perf_counter()
            pushed = self.push(itertools.chain(() if first is None else (first,), it), weight_version=str(version))
            t2 = time.perf_counter()
            self.finish(
                version,
                version_sent=pushed.version_sent,
                flushed=pushed.flushed,
                unconfirmed=pushed.version_unconfirmed,
                ended=pushed.version_sent,  # the end rode behind the version-carrying update
            )
        except Exception as e:  # (not on Ctrl-C: closing may wait sync.step_timeout_s on a hung engine)
            self.close_sessions()
            if isinstance(e, EngineStepError):  # name the training step too (the version being pushed)
                raise EngineStepError(e.urls, e.step, f"{e.detail} (weight sync to version {version})") from e
            raise
        t3 = time.perf_counter()
        verified = verify_sync(self.urls, sent, version=version, timeout_s=self.cfg.step_timeout_s)
        res = SyncResult(
            version=str(version),
            num_bytes=pushed.num_bytes,
            num_buckets=pushed.num_buckets,
            num_tensors=pushed.num_tensors,
            time_s=t3 - t0,
            pause_s=t1 - t0 - first_gather_s,  # the pause's wait that the first bucket's gather did not hide
            gather_s=pushed.gather_s + first_gather_s,
            transfer_s=pushed.transfer_s,
            finish_s=t3 - t2,
            verify=verified,
            verify_s=time.perf_counter() - t3,
            delta=self.delta.stats if self.delta is not None else None,
        )
        log.info(
            "weight sync v%s (%s): %d bytes in %d buckets, %.3f s (%.1f MB/s): control %.3f s, gather %.3f s, "
            "transfer %.3f s",
            res.version,
            self.pause_mode,
            res.num_bytes,
            res.num_buckets,
            res.time_s,
            res.metrics()["sync/bytes_per_s"] / 1e6,
            res.control_s,
            res.gather_s,
            res.transfer_s,
        )
        return res
