"""The broker process's shell: one ZeroMQ ROUTER socket around ``BrokerCore``. Moves bytes only.

Contract
- Socket: the broker **binds** one ROUTER socket (``bind``, default ``tcp://127.0.0.1:0``: the OS
  picks the port; ``address`` is the resolved endpoint, published by ``__main__`` in an address file).
  Agent workers and the actor **connect** DEALER sockets (``client.py``); workers set their ZMQ
  identity to their worker id, so a reconnecting worker keeps its identity.
- High-water marks are 0 (unlimited) on the ROUTER: what can queue is bounded by the admission
  limits (issues <= in-flight groups, at most one batch per actor request), so nothing is ever
  dropped by ZeroMQ. ``ROUTER_MANDATORY`` is on: a send to a peer that vanished raises, and that
  worker is treated as gone (its groups are re-issued).
- Slow joiners: nothing is published; the broker only sends to a worker after its ``hello``
  (request/reply style), so a late connection loses nothing. A worker the broker does not know
  (e.g. declared dead after missed heartbeats) gets ``rehello`` and re-registers.
- One thread, a poll loop: every ready message is drained first (up to ``MAX_MESSAGES_PER_ROUND``);
  finished groups (``group`` / ``groups`` messages) are collected and reach the core in ONE
  ``groups_finished`` call per round (or before any other message, so the order of events is kept);
  every other message becomes one core call. Then the core's outputs (issues, batched per worker,
  cancellations, a ready batch, control changes) are sent.
  ``core.tick()`` runs every ``tick_s`` (heartbeat expiry, the no-data warning).
- A malformed, unknown or other-version message is logged and counted
  (``stats["malformed"]``), answered with ``error`` when the sender is known, never fatal. Every field is
  checked before the core is called, so a rejected message never moves the core's counters
  (``tests/integration/test_broker_fuzz.py`` fuzzes this in process and against the process).
- Signals: SIGINT stops the loop; SIGTERM too, except in a broker with a supervising parent (actor rank 0), which
  defers it while the parent lives and stops on ``shutdown``, SIGINT or the parent's death
  (``install_signal_handlers``): the parent's preemption checkpoint needs the broker's state.
- With a run secret (``ASYNCRL_API_KEY``, ``asyncrl.cluster.auth``) a message without it is refused the same
  way before it reaches the core (``stats["unauthenticated"]``).

    server = BrokerServer(core, bind="tcp://127.0.0.1:0", heartbeat_interval_s=2.0)
    print(server.address); server.serve_forever()   # returns after an actor ``shutdown``
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Optional

import zmq

from asyncrl.broker import protocol as P
from asyncrl.broker.core import BrokerCore, BrokerError, CoreSettings
from asyncrl.cluster import auth

log = logging.getLogger("asyncrl.broker")

MAX_MESSAGES_PER_ROUND = 1024  # bound the work between two flushes of the core's outputs
MAX_WORKER_CAPACITY = 1_000_000  # concurrent trajectories one worker may declare; more is a corrupt hello
SYNC_MODES = ("retract", "in_place", "drain", "abort")  # the pause modes a sync may announce (rollout.pause_mode)


_ALLOWED = P.WORKER_TYPES | P.ACTOR_TYPES


@dataclass
class _PendingBatch:
    ident: bytes
    step: int
    deadline: float
    rows: bool = False
    """The actor asked for compact group rows (``protocol.pack_group_rows``) instead of group maps."""


class BrokerServer:
    def __init__(
        self,
        core: BrokerCore,
        *,
        bind: str = "tcp://127.0.0.1:0",
        heartbeat_interval_s: float = 2.0,
        tick_s: float = 0.2,
        context: Optional[zmq.Context] = None,
    ):
        self.core = core
        self.heartbeat_interval_s = heartbeat_interval_s
        self.tick_s = tick_s
        self.ctx = context or zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.bind(bind)
        self.address: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.stats: Counter[str] = Counter()
        self.secret = auth.current()
        """The run secret every message must carry (``asyncrl.cluster.auth``); None: not checked."""
        self._worker_ident: dict[str, bytes] = {}
        self._pending: Optional[_PendingBatch] = None
        self._control_sent: dict[str, tuple[bool, int]] = {}
        self._stop = False
        self.parent_pid: Optional[int] = None
        """The supervising parent (``install_signal_handlers``); None: a broker on its own."""
        self._sigterm_deferred = False
        self._sigterm_reported = False
        self._last_tick = 0.0
        self._finished: list[tuple[int, Any, bool]] = []  # finished groups received, not yet given to the core
        self._item_wire: dict[int, tuple[Any, dict, list]] = {}  # prompt index -> (item, wire map, wire row)
        self._row_workers: set[str] = set()  # workers that asked for compact issue rows in their hello

    # ----------------------------------------------------------------- loop
    def serve_forever(self) -> None:
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        log.info("broker listening on %s", self.address)
        while not self._stop:
            self.serve_once(poller, timeout_s=self.tick_s)
        self._close()

    def serve_once(self, poller: zmq.Poller, *, timeout_s: float) -> None:
        """One round of the loop: wait up to ``timeout_s`` for messages, handle every ready one, tick when due,
        send the core's outputs. (``serve_forever`` repeats it; tests drive it one round at a time.)"""
        events = dict(poller.poll(timeout=int(timeout_s * 1000)))
        if self.sock in events:
            # drain every ready message first; finished groups reach the core in one call per round
            for _ in range(MAX_MESSAGES_PER_ROUND):
                try:
                    frames = self.sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                self._handle(frames)
                if self._stop:
                    break
            self._finish_pending()
        now = time.monotonic()
        if now - self._last_tick >= self.tick_s:
            self._last_tick = now
            self._watch_parent()
            self.core.tick()
            known = self.core.workers()
            for wid in [w for w in self._worker_ident if w not in known]:  # expired by missed heartbeats
                self._worker_ident.pop(wid)
                self._control_sent.pop(wid, None)
                self.stats["workers_lost"] += 1
        self._flush()

    def stop(self, *_: Any) -> None:
        self._stop = True

    def install_signal_handlers(self, *, parent_pid: Optional[int] = None) -> None:
        """SIGINT stops the broker (after this round; workers are told ``shutdown``). So does SIGTERM, unless the
        broker is a supervised child (``parent_pid``: actor rank 0): then a SIGTERM is deferred while that parent
        lives, since under Slurm a preemption's SIGTERM reaches every process of the step at once and the parent
        still needs the broker to checkpoint its buffered groups; the parent stops it with ``shutdown`` or SIGINT
        (``asyncrl.cluster.process.stop_child``), and the broker stops by itself once the parent is gone."""
        self.parent_pid = parent_pid
        signal.signal(signal.SIGINT, self.stop)
        signal.signal(signal.SIGTERM, self.stop if parent_pid is None else self._defer_sigterm)

    def _defer_sigterm(self, *_: Any) -> None:
        self._sigterm_deferred = True  # logged by the loop (no logging inside a signal handler)

    def _watch_parent(self) -> None:
        """With a supervising parent: stop once it is gone; report a deferred SIGTERM once."""
        if self.parent_pid is None:
            return
        if os.getppid() != self.parent_pid:
            log.warning("the parent (pid %d) is gone; stopping", self.parent_pid)
            self._stop = True
        elif self._sigterm_deferred and not self._sigterm_reported:
            self._sigterm_reported = True
            log.warning(
                "SIGTERM deferred while the parent (pid %d, actor rank 0) lives: it checkpoints the "
                "buffered groups first, then stops the broker",
                self.parent_pid,
            )

    def _close(self) -> None:
        for wid in list(self._worker_ident):
            self._send_worker(wid, P.SHUTDOWN, {})
        self.sock.close(linger=1000)

    # ----------------------------------------------------------------- sending
    def _send(self, ident: bytes, msg_type: str, body: Optional[dict] = None, blobs=()) -> bool:
        frames = [ident, *P.encode(msg_type, body, blobs)]
        try:
            self.sock.send_multipart(frames, copy=len(blobs) == 0)
            return True
        except zmq.ZMQError as e:
            if e.errno == zmq.EHOSTUNREACH:
                return False
            raise

    def _send_worker(self, wid: str, msg_type: str, body: dict) -> None:
        ident = self._worker_ident.get(wid)
        if ident is None or not self._send(ident, msg_type, body):
            self._worker_gone(wid, "unreachable")

    def _worker_gone(self, wid: str, why: str) -> None:
        self._worker_ident.pop(wid, None)
        self._control_sent.pop(wid, None)
        gone = self.core.remove_worker(wid)
        self.stats["workers_lost"] += 1
        log.warning("worker %s gone (%s); %d in-flight groups re-queued", wid, why, len(gone))

    def _flush(self) -> None:
        core = self.core
        cancels: dict[str, list[int]] = {}
        for wid, gid in core.take_cancelled():
            cancels.setdefault(wid, []).append(gid)
        for wid, gids in cancels.items():
            if wid in self._worker_ident:
                self._send_worker(wid, P.CANCEL, {"group_ids": gids})
        self._flush_control()
        for _ in range(8):  # a lost worker re-queues groups, which issues again
            issues = core.take_issues()
            if not issues:
                break
            per_worker: dict[str, list] = {}
            cache, rows_ok = self._item_wire, self._row_workers
            for iss in issues:
                it = iss.item
                hit = cache.get(it.index)
                if hit is None or hit[0] is not it:
                    hit = cache[it.index] = (it, P.item_to_wire(it), P._item_row(it))
                wid = iss.worker_id
                lst = per_worker.get(wid)
                if lst is None:
                    lst = per_worker[wid] = []
                if wid in rows_ok:
                    lst.append([iss.group_id, iss.group_size, iss.version, iss.epoch, hit[2]])
                else:
                    lst.append(
                        {
                            "group_id": iss.group_id,
                            "group_size": iss.group_size,
                            "version": iss.version,
                            "epoch": iss.epoch,
                            "item": hit[1],
                        }
                    )
            for wid, groups in per_worker.items():
                if wid in self._worker_ident:  # else: issued to a worker that just vanished (re-queued)
                    self._send_worker(wid, P.ISSUE, {"rows" if wid in rows_ok else "groups": groups})
        drops = core.take_drops()
        for d in drops if log.isEnabledFor(logging.DEBUG) else ():
            log.debug(
                "dropped group %d (prompt %d, epoch %d): %s%s",
                d.group_id,
                d.item.index,
                d.epoch,
                d.reason,
                " -> retried" if d.retried else "",
            )
        self._flush_batch()

    def _flush_control(self) -> None:
        control = (self.core.hold_new_turns, self.core.version)
        for wid in list(self._worker_ident):
            if self._control_sent.get(wid) != control:
                self._control_sent[wid] = control
                self._send_worker(wid, P.CONTROL, {"hold": control[0], "version": control[1]})

    def _flush_batch(self) -> None:
        pend = self._pending
        if pend is None:
            return
        try:
            batch = self.core.take_batch()
        except BrokerError as e:
            self._pending = None
            self._send(pend.ident, P.ERROR, {"message": str(e), "kind": type(e).__name__})
            return
        if batch is not None:
            self._pending = None
            blobs: list[bytes] = []
            body = {"step": batch.step, "wait_s": batch.wait_s, "metrics": batch.metrics}
            if pend.rows:
                body["rows"] = P.pack_group_rows(batch.groups, blobs)
            else:
                body["groups"] = P.pack_groups(batch.groups, blobs)
            self._send(pend.ident, P.BATCH, body, blobs)
        elif time.monotonic() >= pend.deadline:
            self._pending = None
            self.core.cancel_request()
            self._send(pend.ident, P.TIMEOUT, {"step": pend.step})

    # ----------------------------------------------------------------- receiving
    def _handle(self, frames: list) -> None:
        ident = bytes(frames[0].buffer) if frames else b""
        try:
            msg = P.decode(frames[1:], allowed=_ALLOWED)
            if not auth.secret_matches(msg.token, self.secret):
                self._refuse(ident, msg.type)
                return
            if msg.type in P.WORKER_TYPES:
                self._on_worker(ident, msg)
            else:
                self._finish_pending()
                self._on_actor(ident, msg)
        except (P.ProtocolError, KeyError, TypeError, ValueError, OverflowError) as e:  # bad fields too
            self.stats["malformed"] += 1
            log.warning("malformed message from %r (%d so far): %s", ident, self.stats["malformed"], e)
            if ident:
                self._send(ident, P.ERROR, {"message": f"malformed message: {e}", "kind": "ProtocolError"})

    def _refuse(self, ident: bytes, msg_type: str) -> None:
        """A message without the run secret: counted, answered with an error, nothing else happens."""
        self.stats["unauthenticated"] += 1
        n = self.stats["unauthenticated"]
        if n & (n - 1) == 0:  # 1, 2, 4, 8, ...: a flood does not flood the log
            log.warning("refused %r from %r without the run secret (%d so far)", msg_type, ident, n)
        if ident:
            self._send(
                ident,
                P.ERROR,
                {"message": "unauthenticated: this broker needs the run secret (ASYNCRL_API_KEY)", "kind": "AuthError"},
            )

    def _finish_pending(self) -> None:
        """Hand the finished groups received so far to the core (one call: one admission check)."""
        if self._finished:
            reports, self._finished = self._finished, []
            known = self.core.groups_finished(reports)
            late = len(known) - sum(known)
            if late:
                self.stats["late_reports"] += late

    def _on_worker(self, ident: bytes, msg: P.Message) -> None:
        b = msg.body
        wid = P.worker_id_field(b, msg.type) or ident.decode("utf-8", "replace")
        self.stats["worker_" + msg.type] += 1
        if msg.type == P.GROUPS and wid in self._worker_ident and self.core.heartbeat(wid):
            for gid, trajs, aborted, error in P.unpack_finished_groups(msg):
                if self._foreign(wid, gid):
                    continue
                if aborted and error:
                    log.warning("worker %s aborted group %s: %.200s", wid, gid, error)
                self._finished.append((gid, trajs, aborted))
            return
        self._finish_pending()  # every other message sees the groups that arrived before it
        if msg.type == P.HELLO:
            cap = b.get("capacity")
            if type(cap) is not int or not 1 <= cap <= MAX_WORKER_CAPACITY:
                raise P.ProtocolError(
                    f"hello: field 'capacity' must be an integer in [1, {MAX_WORKER_CAPACITY}], got {cap!r:.80}"
                )
            self._worker_ident[wid] = ident
            if b.get("rows"):
                self._row_workers.add(wid)
            else:
                self._row_workers.discard(wid)
            self._control_sent[wid] = (self.core.hold_new_turns, self.core.version)
            self._send(
                ident,
                P.WELCOME,
                {
                    "version": self.core.version,
                    "group_size": self.core.s.group_size,
                    "hold": self.core.hold_new_turns,
                    "heartbeat_interval_s": self.heartbeat_interval_s,
                },
            )
            self.core.add_worker(wid, capacity=cap)
            log.info("worker %s joined (capacity %d)", wid, cap)
            return
        if wid not in self._worker_ident:
            if msg.type != P.BYE:
                self.stats["unknown_worker"] += 1
                self._send(ident, P.REHELLO, {})
            return
        if msg.type == P.BYE:
            self._worker_gone(wid, "said bye")
            return
        if not self.core.heartbeat(wid):  # the core forgot it (cannot happen while the maps agree)
            self._worker_ident.pop(wid, None)
            self._send(ident, P.REHELLO, {})
            return
        if msg.type == P.TRAJ:
            gid = P.int_field(b, "group_id", P.TRAJ)
            index = P.int_field(b, "index", P.TRAJ)
            if index >= self.core.s.group_size:
                raise P.ProtocolError(
                    f"traj: field 'index' must be < group_size = {self.core.s.group_size}, got {index}"
                )
            traj = None
            if b.get("traj") is not None:
                traj = P.unpack_trajectories([b["traj"]], msg.blobs)[0]
            if not self._foreign(wid, gid):
                self._count_known(self.core.trajectory_finished(gid, index, traj))
        elif msg.type == P.GROUP:
            gid = P.int_field(b, "group_id", P.GROUP)
            metas = b.get("trajs") or []
            if not isinstance(metas, list):
                raise P.ProtocolError(f"group: field 'trajs' must be a list, got {type(metas).__name__}")
            trajs = P.unpack_trajectories(metas, msg.blobs) if metas else None
            if b.get("aborted") and b.get("error"):
                log.warning("worker %s aborted group %s: %.200s", wid, gid, b.get("error"))
            if not self._foreign(wid, gid):
                self._finished.append((gid, trajs, bool(b.get("aborted"))))

    def _foreign(self, wid: str, gid: int) -> bool:
        """A report for a group in flight on ANOTHER worker: ignored and counted (``foreign_reports``), so a
        confused or rogue peer cannot finish -- and get trained -- groups it was never issued."""
        owner = self.core.owner(gid)
        if owner is None or owner == wid:
            return False
        self.stats["foreign_reports"] += 1
        log.warning("worker %s reported group %d, which is in flight on worker %s; ignored", wid, gid, owner)
        return True

    def _count_known(self, known: bool) -> None:
        if not known:
            self.stats["late_reports"] += 1

    def _on_actor(self, ident: bytes, msg: P.Message) -> None:
        b, core = msg.body, self.core
        self.stats["actor_" + msg.type] += 1
        try:
            if msg.type == P.GET_BATCH:
                if self._pending is not None and self._pending.ident != ident:
                    raise P.ProtocolError("get_batch: another actor request is already pending")
                step = P.int_field(b, "step", P.GET_BATCH)
                timeout_s = P.float_field(b, "timeout_s", P.GET_BATCH, lo=0.0, hi=P.MAX_TIMEOUT_S)
                actor_version = P.int_field(b, "actor_version", P.GET_BATCH, default=None)
                self._pending = _PendingBatch(ident, step, time.monotonic() + timeout_s, bool(b.get("rows", False)))
                core.request_batch(step, actor_version=actor_version)
                self._flush_batch()
            elif msg.type == P.SYNC_BEGIN:
                mode = b.get("mode", "retract")
                if mode not in SYNC_MODES:
                    raise P.ProtocolError(
                        f"sync_begin: field 'mode' must be one of {list(SYNC_MODES)}, got {mode!r:.80}"
                    )
                core.sync_begin(mode)
                self._flush_control()  # the hold is on its way to every worker before the actor hears OK
                self._send(ident, P.OK)
            elif msg.type == P.SYNC_END:
                core.sync_end(P.int_field(b, "version", P.SYNC_END))
                self._flush_control()
                self._send(ident, P.OK)
            elif msg.type == P.HOLD_ISSUING:
                core.hold_issuing()
                self._send(ident, P.OK)
            elif msg.type == P.RELEASE_ISSUING:
                core.release_issuing()
                self._send(ident, P.OK)
            elif msg.type == P.BATCH_FILTERED:
                core.batch_filtered(
                    P.int_list_field(b, "group_ids", P.BATCH_FILTERED, max_len=core.s.rollout_batch_size)
                )
                self._send(ident, P.OK)
            elif msg.type == P.ENGINE_FIGURES:
                figures = {k: float(b[k]) for k in ("running_reqs", "queue_reqs", "gen_tokens_per_s")}
                bad = [k for k, v in figures.items() if not v >= 0]
                if bad:
                    raise ValueError(f"engine_figures: {bad} must be numbers >= 0, got {figures}")
                core.engine_figures(**figures)
                self._send(ident, P.OK)
            elif msg.type == P.METRICS:
                self._send(
                    ident,
                    P.METRICS,
                    {"metrics": core.last_metrics, "counters": dict(core.counters), "status": self.status()},
                )
            elif msg.type == P.STATUS:
                self._send(ident, P.STATUS, self.status())
            elif msg.type == P.GET_STATE:
                body, blobs = P.pack_state(core.state_dict())
                self._send(ident, P.STATE, {"state": body}, blobs)
            elif msg.type == P.SET_STATE:
                core.load_state_dict(P.unpack_state(b["state"], msg.blobs))
                self._send(ident, P.OK)
            elif msg.type == P.SHUTDOWN:
                self._send(ident, P.OK)
                self._stop = True
        except (BrokerError, ValueError) as e:
            if isinstance(e, P.ProtocolError):
                raise
            if msg.type == P.GET_BATCH:
                self._pending = None
            self.stats["actor_errors"] += 1
            self._send(ident, P.ERROR, {"message": str(e), "kind": type(e).__name__})
        except (KeyError, TypeError) as e:
            raise P.ProtocolError(f"{msg.type}: {e!r}") from None

    def status(self) -> dict:
        c = self.core
        return {
            "version": c.version,
            "num_inflight_groups": c.num_inflight_groups,
            "num_inflight_samples": c.num_inflight_samples,
            "num_buffered_groups": c.num_buffered_groups,
            "workers": c.workers(),
            "hold": c.hold_new_turns,
            "waiting_step": c.waiting_step,
            "issuing_held": c.issuing_held,
            "failure": None if c.failure is None else str(c.failure),
            "counters": dict(c.counters),
            "stats": dict(self.stats),
        }


def tune_gc() -> None:
    """For a process that moves many short-lived, acyclic objects (groups, trajectories, message maps): the
    objects alive now (modules, prompts) leave the collector's view and young collections run 50x less often
    (each one walks every tracked young object). Reference counting still frees all acyclic garbage at once."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(35_000, 20, 20)


def run_broker(
    cfg,
    prompts: list,
    *,
    source: str = "",
    bind: str = "tcp://127.0.0.1:0",
    address_file: Optional[str] = None,
    num_skipped_long_prompts: int = 0,
    parent_pid: Optional[int] = None,
) -> None:
    """Build the core from a resolved ``Config`` and the ``prompts`` (``PromptItem``s, loaded by the caller from
    ``source``; ``num_skipped_long_prompts`` of them were left out by ``data.max_prompt_tokens``), serve until
    shutdown. Publishes the endpoint. ``parent_pid``: the supervising parent (see ``install_signal_handlers``)."""
    if parent_pid is not None and os.getppid() != parent_pid:
        raise RuntimeError(f"broker: its parent (pid {parent_pid}) is already gone")
    core = BrokerCore(prompts, settings=CoreSettings.from_config(cfg), clock=time.monotonic)
    core.num_skipped_long_prompts = num_skipped_long_prompts
    server = BrokerServer(core, bind=bind, heartbeat_interval_s=cfg.agentloop.heartbeat_interval_s)
    server.install_signal_handlers(parent_pid=parent_pid)
    tune_gc()
    if address_file:
        tmp = f"{address_file}.tmp{os.getpid()}"
        with open(tmp, "w") as f:
            f.write(server.address)
        os.replace(tmp, address_file)
    print(f"ASYNCRL_BROKER_ADDRESS={server.address}", flush=True)
    log.info(
        "broker: %d prompts from %s, limits inflight=%d buffered=%d batch=%d group_size=%d (%s, %s mode)",
        len(prompts),
        source,
        core.s.max_inflight_groups,
        core.s.max_buffered_groups,
        core.s.rollout_batch_size,
        core.s.group_size,
        core.s.submission_granularity,
        "sync" if core.s.sync_mode else "async",
    )
    server.serve_forever()
    sys.stdout.flush()
