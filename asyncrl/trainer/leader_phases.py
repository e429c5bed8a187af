"""Leader-only phases of the actor group: actor rank 0 works alone, the other actor ranks wait on the store.

Contract
- The actor group's collectives have one timeout (``cluster.actor_collective_timeout_s``). A phase in which
  actor rank 0 works alone (the before/after eval, a periodic eval on the shared engines, waiting for a
  batch from the broker, the end of the run) must not count against it, so the other ranks do not wait
  for it inside a collective: every actor rank calls ``phases.run(name, fn, timeout_s=...)`` at the same
  point; rank 0 runs ``fn()`` and then publishes the phase's end under ``phase/<seq>`` (``ok`` or the
  error); the others poll that key and only then go on to the next collective.
- Every actor rank bumps its own heartbeat (``beat_key(rank)``) from a thread every ``heartbeat_s`` for the whole
  run. A waiting rank fails, naming the phase, when rank 0 reports a failure, when ``timeout_s`` (the phase's
  own deadline; None = none) plus ``margin_s`` passes, or when rank 0's heartbeat stops for ``dead_after_s``: a
  dead or hung leader is noticed in seconds, a slow one never.
- Every actor rank runs the same phases in the same order (the sequence number is the key).
- Every rank watches the heartbeats of the actor ranks other than itself for the whole run (``watch_actor_ranks``):
  with one actor rank nobody else would notice a stopped or hung rank 0 and the job would wait forever with full
  buffers; with several, the others would wait in their next collective for ``cluster.actor_collective_timeout_s``
  (30 min). A rank's watch arms at its first beat (start-up has its own timeouts) and ends for it when it closes
  its phases (``DONE_MARK`` added to its counter), for all when rank 0 does, so a finished run is never taken for a
  dead one. A watcher reads all its ranks' counters in one ``multi_get`` a second. ``Heartbeat`` is its pure core,
  shared with the waits above. Its owner stops it (``ActorWatch.stop``) before the process exits, as ``close`` stops
  the heartbeat thread: a thread left inside a store call at exit aborts the process.
- Every actor rank publishes its process identity (``proc_key``; ``asyncrl.cluster.stopped_peer``). A watcher that
  sees a rank's heartbeat stop SIGKILLs that rank first if it is a stopped process of this host (it could not act on
  torchrun's SIGTERM, and torchrun would wait out its 30 s shutdown timeout), and says so in the failure.

    phases = LeaderPhases(store, rank=actor_rank, heartbeat_store=new_client())
    batch = phases.run("get_batch", lambda: broker.get_batch(...), timeout_s=t)   # None on the others
    phases.close()
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Optional, TypeVar

from asyncrl.cluster.stopped_peer import identity, kill_if_stopped

log = logging.getLogger("asyncrl.leader")

T = TypeVar("T")

_POLL_S = 0.05  # a waiting rank's store poll: cheap, and the next collective starts within it


class LeaderFailed(RuntimeError):
    """Actor rank 0 failed or vanished during a leader-only phase (seen from another actor rank)."""


class Heartbeat:
    """Pure: an actor rank's beat counter as one watcher sees it. ``observe(beat, now)`` returns the seconds without a
    new beat once they exceed ``dead_after_s`` (else None). Unarmed (``armed=False``), nothing counts until the first
    beat (a counter above 0) is seen."""

    def __init__(self, dead_after_s: float, now: float, *, armed: bool = True):
        self.dead_after_s = dead_after_s
        self.armed = armed
        self.last_beat, self.last_change = -1, now

    def observe(self, beat: int, now: float) -> Optional[float]:
        if beat != self.last_beat:
            self.last_beat, self.last_change = beat, now
            self.armed = self.armed or beat > 0
            return None
        silent = now - self.last_change
        return silent if self.armed and silent > self.dead_after_s else None


def proc_key(actor_rank: int) -> str:
    """Where actor rank ``actor_rank`` publishes its process identity (``stopped_peer.identity``)."""
    return f"proc/{actor_rank}"


def _end_if_stopped(store: Any, rank: int) -> str:
    """``stopped_peer.kill_if_stopped`` on actor rank ``rank``'s published identity: what was done (a sentence
    beginning with "; "), or "" when nothing was (not published, another host, not stopped, the store silent)."""
    try:
        if not store.check([proc_key(rank)]):
            return ""
        done = kill_if_stopped(store.get(proc_key(rank)).decode())
    except (RuntimeError, OSError, ValueError) as e:
        log.debug("could not read actor rank %d's identity: %r", rank, e)
        return ""
    return f"; {done}" if done else ""


def beat_key(actor_rank: int) -> str:
    """The store counter actor rank ``actor_rank``'s heartbeat thread bumps."""
    return f"alive/{actor_rank}"


DONE_MARK = 1 << 40
"""Added to a rank's heartbeat counter when it closes its phases (its beat stops on purpose): the watchers read
every watched rank's counter, and so whether it is done, in one ``multi_get`` a poll."""


class LeaderPhases:
    def __init__(
        self,
        store: Any,
        *,
        rank: int,
        heartbeat_store: Any,
        heartbeat_s: float = 1.0,
        dead_after_s: float = 30.0,
        margin_s: float = 60.0,
    ):
        """``store``: a torch.distributed store (a ``PrefixStore`` of this run) every actor rank reaches; ``rank``:
        this process's rank in the actor group; ``heartbeat_store``: a second client of the store for this rank's
        heartbeat thread (a store client is used from one thread at a time)."""
        self.store, self.rank, self.is_leader = store, rank, rank == 0
        self.heartbeat_s, self.dead_after_s, self.margin_s = heartbeat_s, dead_after_s, margin_s
        self._seq = 0
        store.set(proc_key(rank), identity())
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._beat, args=(heartbeat_store,), name=f"actor-{rank}-heartbeat", daemon=True
        )
        self._thread.start()

    def _beat(self, store: Any) -> None:
        while not self._stop.is_set():
            try:
                store.add(beat_key(self.rank), 1)
            except (RuntimeError, OSError) as e:  # the store's agent is gone: so is the job (the watchers see silence)
                log.debug("actor rank %d: heartbeat stopped, the store does not answer: %r", self.rank, e)
                return
            self._stop.wait(self.heartbeat_s)

    def run(self, name: str, fn: Callable[[], T], *, timeout_s: Optional[float] = None) -> Optional[T]:
        """``fn()`` on the leader (its result), a store wait on the others (None); see the contract."""
        self._seq += 1
        key = f"phase/{self._seq}"
        if self.is_leader:
            try:
                out = fn()
            except BaseException as e:
                self.store.set(key, f"failed: {type(e).__name__}: {e}".encode())
                raise
            self.store.set(key, b"ok")
            return out
        self._wait(key, name, timeout_s)
        return None

    def _wait(self, key: str, name: str, timeout_s: Optional[float]) -> None:
        start = time.monotonic()
        deadline = None if timeout_s is None else start + timeout_s + self.margin_s
        hb = Heartbeat(self.dead_after_s, start)
        while not self.store.check([key]):
            now = time.monotonic()
            silent = hb.observe(self.store.add(beat_key(0), 0), now)
            if silent is not None:
                raise LeaderFailed(
                    f"actor rank 0 stopped heartbeating during its phase {name!r} (no sign for "
                    f"{silent:.0f}s): it died or hangs; see its log"
                )
            if deadline is not None and now > deadline:
                raise LeaderFailed(
                    f"actor rank 0 did not finish its phase {name!r} within {timeout_s:.0f}s "
                    f"(+{self.margin_s:.0f}s margin)"
                )
            time.sleep(_POLL_S)
        value = self.store.get(key).decode()
        if value != "ok":
            raise LeaderFailed(f"actor rank 0 failed in its phase {name!r}: {value}")
        log.debug("leader phase %r ended after %.1fs", name, time.monotonic() - start)

    def close(self) -> None:
        if self._stop.is_set():
            return
        try:  # first: the beat stops on purpose, and the watchers stand down (for every rank when rank 0 closes)
            self.store.add(beat_key(self.rank), DONE_MARK)
        except (RuntimeError, OSError) as e:  # the store's agent is gone: so is the job
            log.debug("could not mark the heartbeat done: %r", e)
        self._stop.set()
        self._thread.join(timeout=self.heartbeat_s + 5)


class ActorWatch:
    """A running ``watch_actor_ranks``: ``stop()`` ends it (and waits for it) before this process exits."""

    def __init__(self, thread: threading.Thread, stop: threading.Event, poll_s: float):
        self.thread, self._stop, self._poll_s = thread, stop, poll_s

    def stop(self, timeout_s: float = 5.0) -> bool:
        """End the watch; True when its thread is gone. Call it before the interpreter exits: a daemon thread inside a
        store call when Python finalizes is ended by ``pthread_exit``, whose unwind through torch's C++ frames aborts
        the process (SIGABRT, 'terminate called without an active exception') after a run that succeeded."""
        self._stop.set()
        self.thread.join(timeout=self._poll_s + timeout_s)
        return not self.thread.is_alive()


def watch_actor_ranks(
    store: Any,
    *,
    ranks: Sequence[int],
    dead_after_s: float,
    on_dead: Callable[[str], None],
    poll_s: float = 1.0,
) -> ActorWatch:
    """Watch the heartbeats of actor ranks ``ranks`` on a daemon thread until the run ends or ``stop()`` (contract):
    ``on_dead(message)`` once one of them stops for ``dead_after_s`` before it or rank 0 is done. ``store``: a client
    of the phases' store used by this thread only. A store that does not answer counts as no beat (its agent's death
    is the parent watchdog's)."""
    stop = threading.Event()

    def watch() -> None:
        now = time.monotonic()
        beats = {r: Heartbeat(dead_after_s, now, armed=False) for r in ranks}
        created = False
        while beats and not stop.is_set():
            try:
                if not created:  # multi_get waits for a key that does not exist yet: make each one (at 0)
                    for r in beats:
                        store.add(beat_key(r), 0)
                    created = True
                seen = dict(zip(beats, map(int, store.multi_get([beat_key(r) for r in beats]))))
            except (RuntimeError, OSError, ValueError) as e:
                log.debug("actor heartbeat read failed: %r", e)
                seen = {r: hb.last_beat for r, hb in beats.items()}
            if seen.get(0, 0) >= DONE_MARK:  # rank 0 closed: the run is over for everyone
                return
            for r in [r for r, beat in seen.items() if beat >= DONE_MARK]:  # a rank that ended first
                del beats[r], seen[r]
            now = time.monotonic()
            for r, beat in seen.items():
                silent = beats[r].observe(beat, now)
                if silent is not None:
                    on_dead(
                        f"actor rank {r} stopped heartbeating {silent:.0f} s ago (> cluster.actor_unresponsive_after_s "
                        f"= {dead_after_s:g} s): it is stopped, hung or starved; see its log{_end_if_stopped(store, r)}"
                    )
                    return
            stop.wait(poll_s)

    t = threading.Thread(target=watch, name="actor-watch", daemon=True)
    t.start()
    return ActorWatch(t, stop, poll_s)
