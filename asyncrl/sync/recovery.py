"""Actor side of engine recovery: re-join restarted engines, bring them to the current weights, retry a
sync that a dying engine broke.

Contract
- Who calls whom: a rollout rank restarts its dead or hung engine (``asyncrl.agent.worker``) and
  publishes the engine's restart count; ``EngineRecovery`` (actor rank 0) reads those counts
  without blocking (``read_restarts(i)``) and, after a sync that carried the current weights into
  restart ``n`` of engine ``i``, publishes ``publish_synced(i, n)``. The worker takes work again only
  after that, so a restarted engine never generates with stale weights.
- ``pending()``: an engine restarted and was not synced yet; the step loop then runs a catch-up sync
  (same version) instead of waiting for data, since that engine's worker waits for it.
- ``sync_weights(...)`` is collective on every actor rank (the bucket gather is): the leader first
  re-creates the weight-sync group if an engine restarted since it was formed, then runs the sync.
  A failure (``EngineStepError``, ``GroupJoinError``, or the broadcast's ``RuntimeError``) is retried
  only if an engine restart shows up within ``wait_s`` (the rollout rank noticed the death or hang and
  restarted it); otherwise it propagates, naming the engine. Before deciding, every rank finishes
  iterating its buckets, then the leader's verdict is broadcast so all ranks retry together.
- ``abandon`` (``EngineRecovery.abandon``, set by the step loop to "a preemption signal arrived"): a failed
  sync is not retried nor waited for once it is true; every actor rank raises ``SyncAbandoned`` (the engines
  keep their old weights; the run is stopping and its checkpoint carries the new ones).
- Invariant: after ``sync_weights`` returns, every engine, restarted or not, serves the actor's
  current version and is in the group.
- Catch-up by pulling (``sync.catchup = "pull"``, ``puller`` set): on the leader, ``sync_weights`` keeps a copy of
  the buckets it sends and writes the version to the weight store once the sync succeeded
  (``asyncrl.sync.weight_store``); ``catch_up()`` (called by the leader's batch wait when ``pending()``) makes every
  restarted engine pull the store's latest version (``asyncrl.sync.catchup``) and publishes it synced, with no
  collective and no push; the group is re-formed at the next sync (``before_sync``) as before. A pull that fails
  leaves the engine pending: the step loop's catch-up sync (a full push) covers it, as without a store.
- An engine that misses a broadcast falls back to pulling (``sync.catchup = "pull"``): when a sync fails, the
  leader (every rank has finished its buckets, so the capture is whole) writes that version to the store and every
  engine pulls it (``pull_instead``), paused, then is resumed; an engine whose port refuses connections (its
  process is gone: ``catchup.gone``) is skipped and pulls once its rollout rank restarted it (``catch_up``). The sync
  then counts as done (no wait for the restart, no retried push); the group is marked stale and re-formed at the
  next sync. While the dead engine has not restarted, that re-formation fails at once (its ``/model_info`` is
  refused) and the sync falls back to pulling again. An engine that still listens but fails its pull sends the sync
  down the old path (wait for its restart, retry the push).

    rec = EngineRecovery(group, read_restarts=lambda i: ..., publish_synced=lambda i, n: ..., wait_s=150,
                         max_failures=4)
    res = sync_weights(actor, syncer, rec, bucket_bytes=cfg.sync.bucket_bytes, is_leader=True, bcast=bcast)
    m["rollout/engine_restarts"] = float(rec.total_restarts())
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Optional

from asyncrl.engine.blocking import EngineStepError
from asyncrl.sync.catchup import Puller, gone
from asyncrl.sync.group import GroupJoinError, WeightSyncGroup
from asyncrl.sync.weight_store import StoreCorruption
from asyncrl.sync.weight_sync import SyncResult

log = logging.getLogger(__name__)

# How often a failed sync re-reads the restart counts while it waits for the rollout rank's verdict.
_POLL_S = 0.2
# Errors a dying engine causes in a sync (the broadcast to a dead peer raises a RuntimeError from torch).
_SYNC_ERRORS = (EngineStepError, GroupJoinError, RuntimeError)


class SyncAbandoned(RuntimeError):
    """A failed weight sync given up because the run is stopping (``EngineRecovery.abandon``)."""


class EngineRecovery:
    """Restart counts seen, joined and synced, per engine of one weight-sync group (see module contract)."""

    def __init__(
        self,
        group: WeightSyncGroup,
        *,
        read_restarts: Callable[[int], int],
        publish_synced: Callable[[int, int], None],
        wait_s: float,
        max_failures: int,
    ):
        self.group = group
        self.max_failures = max_failures
        self.failures = 0
        self.read_restarts = read_restarts
        self.publish_synced = publish_synced
        self.wait_s = wait_s
        self.abandon: Callable[[], bool] = lambda: False
        """True once a failed sync should be given up rather than retried (the run is stopping)."""
        n = len(group.engines)
        self.joined = [0] * n
        """Restart count of each engine when the group was last formed."""
        self.synced = [0] * n
        """Restart count of each engine that the last successful sync (or its catch-up pull) covered."""
        self.puller: Optional[Puller] = None
        """Set under ``sync.catchup = "pull"``: syncs write the weight store, restarted engines pull from it."""
        self.stale = False
        """The group is broken (a sync failed and was finished by pulling): re-formed before the next sync."""

    def _counts(self) -> list[int]:
        return [self.read_restarts(i) for i in range(len(self.joined))]

    def total_restarts(self) -> int:
        return sum(self._counts())

    def pending(self) -> bool:
        """An engine restarted and has not been synced since."""
        return any(c > s for c, s in zip(self._counts(), self.synced))

    def restarted(self) -> Optional[list[int]]:
        """The restart counts when an engine restarted since the group was formed (None: none did). The sharded
        topology re-forms its groups on every actor rank, then sets ``joined`` to them."""
        counts = self._counts()
        return None if counts == self.joined else counts

    def before_sync(self) -> None:
        """Re-form the group if an engine restarted since it was formed (the restarted one left it)."""
        counts = self.restarted()
        if counts is None and not self.stale:
            return
        if counts is None:
            log.warning("the last sync broke the weight-sync group: re-forming it")
            counts = self._counts()
        else:
            moved = [self.group.engines[i].url for i, (c, j) in enumerate(zip(counts, self.joined)) if c != j]
            log.warning("engine(s) %s restarted: re-forming the weight-sync group", ", ".join(moved))
        self.group.recreate()  # a failure leaves joined and stale as they were: the next sync tries again
        self.joined, self.stale = counts, False

    def catch_up(self) -> bool:
        """Every restarted engine not synced yet pulls the store's latest version and is published synced; True
        when none is left pending (False without a puller, or when a pull failed: the caller pushes instead)."""
        if self.puller is None:
            return False
        for i, (c, s) in enumerate(zip(self._counts(), self.synced)):
            if c <= s:
                continue
            url = self.group.engines[i].url
            try:
                self.puller.pull(url)
            except (EngineStepError, StoreCorruption, OSError) as e:  # a dead engine again, or the store
                log.warning("catch-up pull into engine %s (restart %d) failed: %s; a full sync will push", url, c, e)
                return False
            self.synced[i] = c
            self.publish_synced(i, c)
        return not self.pending()

    def pull_instead(
        self, err: BaseException, *, version: int, state: dict, resume: Callable[[list[str]], None]
    ) -> bool:
        """After the failed sync ``err`` at ``version`` (leader; ``state``: that version's every tensor, captured
        whole): the store gets the version and every engine pulls it, an engine whose process is gone excepted (see
        module contract); ``resume`` gets the engines that pulled. True when the sync counts as done; False without
        a puller, once ``abandon()`` holds, or when an engine that still listens failed its pull."""
        if self.puller is None or self.abandon():
            return False
        log.warning(
            "weight sync to version %d failed (%s): the engines pull it from the weight store instead", version, err
        )
        store = self.puller.store
        store.wait()
        store.put(version, state)
        counts, pulled, skipped = self._counts(), [], []
        for i, e in enumerate(self.group.engines):
            try:
                self.puller.pull(e.url)
            except (EngineStepError, StoreCorruption, OSError) as pe:
                if not gone(e.url):
                    log.warning("engine %s failed its pull (%s) and still listens: waiting for its restart", e.url, pe)
                    return False
                skipped.append(e.url)
                continue
            pulled.append(i)
        self.stale = True
        resume([self.group.engines[i].url for i in pulled])
        for i in pulled:
            if counts[i] > self.synced[i]:  # restarted meanwhile and pulled: its worker may take work
                self.synced[i] = counts[i]
                self.publish_synced(i, counts[i])
        self.puller.num_fallbacks += 1
        if skipped:
            log.warning(
                "engine(s) %s gone (connection refused): each pulls version %d once restarted", skipped, version
            )
        return True

    def after_sync(self) -> None:
        for i, (j, s) in enumerate(zip(self.joined, self.synced)):
            if j > s:
                self.publish_synced(i, j)
                log.info("engine %s (restart %d) carries the current weights again", self.group.engines[i].url, j)
        self.synced = list(self.joined)

    def after_failure(self, err: BaseException) -> bool:
        """True when an engine restart (not yet joined) explains ``err`` (retry); False as soon as ``abandon()``
        holds; re-raise ``err`` after ``wait_s``."""
        self.failures += 1
        if self.abandon():
            return False
        if self.failures > self.max_failures:
            raise err
        deadline = time.monotonic() + self.wait_s
        log.warning("weight sync failed (%s); waiting up to %.0f s for the engine's restart", err, self.wait_s)
        while self._counts() == self.joined:
            if self.abandon():
                return False
            if time.monotonic() > deadline:
                raise err
            time.sleep(_POLL_S)
        return True


def sync_weights(
    actor,
    syncer,
    recovery: Optional[EngineRecovery],
    *,
    bucket_bytes: int,
    is_leader: bool,
    bcast: Callable[[Any], Any],
):
    """One weight sync at ``actor.version`` that survives engine restarts (collective; see module contract).
    Returns the leader's ``SyncResult`` (None on other ranks)."""
    store = recovery.puller.store if is_leader and recovery is not None and recovery.puller is not None else None
    while True:
        buckets = iter(actor.iter_hf_buckets(bucket_bytes))
        if store is not None:
            buckets = store.capture(buckets)
        res, err = None, None
        if is_leader:
            try:
                if recovery is not None:
                    recovery.before_sync()
                res = syncer.sync(buckets, version=actor.version)
            except _SYNC_ERRORS as e:
                if recovery is None:
                    raise
                err = e
        for _ in buckets:  # the rest of the gather (every rank takes part), also after a failure
            pass
        verdict = None
        if err is not None:
            t0 = time.perf_counter()
            if (
                store is not None
                and store.captured_whole
                and recovery.pull_instead(
                    err,
                    version=int(actor.version),
                    state=store.captured,
                    resume=lambda urls: syncer.resume(urls, actor.version),
                )
            ):
                res = pulled_result(actor.version, store.captured, time.perf_counter() - t0)
            else:
                verdict = "retry" if recovery.after_failure(err) else "abandon"
        elif is_leader and recovery is not None:
            if store is not None:  # before the restarts are published synced: a pull from here on finds this version
                store.put_async(int(actor.version), store.captured)
            recovery.after_sync()
        if follow_verdict(bcast(verdict), version=actor.version, err=err):
            return res


def follow_verdict(verdict: Optional[str], *, version: Any, err: Optional[BaseException]) -> bool:
    """Every actor rank, after a sync attempt, with the leader's broadcast verdict: True when the sync is done, False
    to retry it; ``SyncAbandoned`` when the leader gave it up (the run is stopping)."""
    if verdict is None:
        return True
    if verdict == "abandon":
        raise SyncAbandoned(
            f"weight sync at version {version} abandoned: the run is stopping"
            + (f" ({err})" if err is not None else "")
        )
    log.info("retrying the weight sync at version %s", version)
    return False


def pulled_result(version: Any, state: dict, seconds: float) -> SyncResult:
    """The figures of a sync the engines finished by pulling (``pull_instead``): every tensor, no bucket broadcast."""
    return SyncResult(
        version=str(version),
        num_bytes=sum(int(t.numel() * t.element_size()) for t in state.values()),
        num_buckets=0,
        num_tensors=len(state),
        time_s=seconds,
        pause_s=0.0,
        gather_s=0.0,
        transfer_s=seconds,
        finish_s=0.0,
    )
